"""Every `difftest` subcommand's parser and handler (difftest/cli.py lists them): each module turns
a command line into calls of the house's parts and their outcome into an exit code, and holds no
comparison of its own."""
