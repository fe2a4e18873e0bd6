"""One module per subcommand; each exposes `register(subparsers)` and is found automatically."""
