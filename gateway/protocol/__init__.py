"""The wire models more than one layer speaks; a model only one API uses lives in `apis/<api>/<api>_wire.py`."""
