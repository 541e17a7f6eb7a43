"""`pretrain` as a script file, for launchers that run a file rather than a module.

DeepSpeed's Slurm and MPI backends start `python -u <user_script>` on every rank (they ignore
`--module`); this file keeps `sys.path[0]` out of the package, where `python pretrain/__main__.py`
would let `pretrain/config.py`, `pretrain/data/` etc. shadow top-level modules.
"""
from pretrain.cli import main

if __name__ == "__main__":
    main()
