"""One module per `pretrain` subcommand, each with `add_arguments(parser)` and `run(args)`;
`pretrain.cli` wires them. A command module imports only argparse, the standard library and light
`pretrain` modules at its top and does its heavy imports (torch, DeepSpeed, the planner) inside
`run`, so that `pretrain --help` stays fast."""
