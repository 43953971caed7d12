"""`train`'s checks of its flags, the --plan file and the devices: user mistakes found here
are one `error:` line (`embark_jax.cli.errors`), before anything is written."""

from __future__ import annotations

from embark_jax.cli.errors import CLIError, check_writable_dir, check_writable_file, require

__all__ = ["check_args", "check_devices"]


def check_args(args, default_batch: int):
    """Every check that needs no devices, before JAX starts; returns the --plan file's plan.
    Output paths are probed (nothing is created) so a bad one fails before step 1."""
    from embark_jax.core.plan import Plan

    require(not args.resume or args.checkpoint_dir, "--resume needs --checkpoint-dir")
    require(
        not args.save_every or args.checkpoint_dir,
        f"--save-every {args.save_every} needs --checkpoint-dir",
    )
    if args.checkpoint_dir and not args.resume:
        _check_fresh_checkpoint_dir(args.checkpoint_dir)
    require(not (args.plan and args.baseline), "--plan and --baseline exclude each other")
    for path, flag in ((args.out, "--out"), (args.plan_out, "--plan-out")):
        if path:
            check_writable_file(path, flag)
    for path, flag in ((args.checkpoint_dir, "--checkpoint-dir"), (args.log_dir, "--log-dir")):
        if path:
            check_writable_dir(path, flag)
    plan_file = Plan.from_file(args.plan) if args.plan else None
    if plan_file is None:
        args.batch_size = args.batch_size or default_batch
    elif args.batch_size is None:
        args.batch_size = plan_file.batch_size
    elif args.batch_size != plan_file.batch_size:
        raise CLIError(
            f"--batch-size {args.batch_size} differs from the batch {plan_file.batch_size} "
            f"that --plan {args.plan!r} was made for; leave --batch-size out or re-plan"
        )
    return plan_file


def _check_fresh_checkpoint_dir(directory: str) -> None:
    """A run that does not resume must not mix its checkpoints with another run's."""
    from embark_jax.training.checkpoint_dir import latest_step

    step = latest_step(directory)
    if step is not None:
        raise CLIError(
            f"--checkpoint-dir {directory} already holds checkpoints (latest step {step}); "
            "add --resume to continue that run, or choose an empty directory"
        )


def check_devices(args, g: int, plan_file) -> None:
    """The checks that need the device count `g`."""
    require(g % args.nodes == 0, f"{g} devices do not split into --nodes {args.nodes}")
    require(
        args.batch_size % g == 0,
        f"--batch-size {args.batch_size} is not a multiple of the {g} devices",
    )
    if plan_file is None:
        return
    t = plan_file.topology
    if t.num_devices != g:
        raise CLIError(
            f"--plan {args.plan!r} is for {t.num_nodes}x{t.devices_per_node} = "
            f"{t.num_devices} devices but this run has {g}; run it with --devices "
            f"{t.num_devices} --nodes {t.num_nodes} (fake CPU devices), or re-plan for {g}: "
            f"python -m embark_jax plan --model {args.model} --nodes {args.nodes} "
            f"--devices-per-node {g // args.nodes} --topology local --out plan.json"
        )
    require(
        t.num_nodes == args.nodes,
        f"--plan {args.plan!r} is for {t.num_nodes} node(s): pass --nodes {t.num_nodes}",
    )
