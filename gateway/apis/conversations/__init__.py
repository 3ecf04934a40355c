"""OpenAI's Conversations API (`/v1/conversations`): conversations and their items, kept with the stored responses."""
