"""The dashboard server's defaults, importable without Dash or torch (the command line's parser
reads them before it knows whether it will serve anything)."""

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8050
DEFAULT_THREADS = 8
DEFAULT_TORCH_THREADS = 1  # small models, several request threads: intra-op threads only spin-wait on a busy CPU
