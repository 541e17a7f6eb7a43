"""`python -m pretrain ...` is the same as the `pretrain` command."""
from pretrain.cli import main

if __name__ == "__main__":
    main()
