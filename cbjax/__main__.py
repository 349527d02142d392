"""`python -m cbjax` runs the Hydra CLI."""

from cbjax.app.cli import main

if __name__ == "__main__":
    main()
