"""The `pretrain` subcommands: argparse at the top of each module, the heavy imports inside its
`run()`, so `pretrain --help` starts without torch or DeepSpeed."""
