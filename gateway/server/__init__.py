"""The process: the command line, the HTTP server around the app, worker processes and TLS."""
