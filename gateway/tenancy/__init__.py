"""Who is asking and what they may spend: keys, the keys file, limits, budgets and priority."""
