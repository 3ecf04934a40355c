"""The files API."""
