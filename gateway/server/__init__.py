"""The process: the command line (`cli`), the HTTP server around the app (`http`: uvicorn's
config, the header-bounded protocol, the drain on SIGTERM) and TLS (`tls`)."""
