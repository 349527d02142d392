"""`python -m cbjax.bench` runs the cbjax-bench Hydra app."""

from cbjax.bench.cli import main

if __name__ == "__main__":
    main()
