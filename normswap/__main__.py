"""``python -m normswap`` runs the command-line interface."""

from normswap.cli import main

if __name__ == "__main__":
    main()
