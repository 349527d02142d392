"""`python -m cbjax.serve` runs the cbjax-serve Hydra app."""

from cbjax.serve.cli import main

if __name__ == "__main__":
    main()
