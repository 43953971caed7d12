"""`python -m embark_jax train`: the main job. Defaults train DLRM-DCNv2-mini (the paper's
26 tables with vocabularies scaled down) on the synthetic Zipf dataset, on 8 fake CPU devices
when there is no accelerator, with the planner's plan."""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
import signal
import sys
import threading
import time
import warnings

from embark_jax.cli import train_dynamic
from embark_jax.cli.errors import INTERRUPTED, CLIError, make_parent
from embark_jax.cli.train_args import (  # noqa: F401  (re-exported for the CLI front)
    DEFAULT_BATCH,
    OPTIMIZERS,
    add_train_args,
    data_source,
)
from embark_jax.cli.train_checks import check_args, check_devices


def _datasets(args, config, say, dynamic=None, full=None):
    """(training dataset, evaluation batches) for --data. Criteo data holds out its last
    `--eval-batches` batches for evaluation when it has at least twice that many samples.
    `dynamic`: the dynamic tables' features, served with their raw ids; `full`: the config
    with them as fixed features (the preset's order: Criteo's columns; synthetic data
    draws their ids from the preset's vocabularies)."""
    import jax

    kind, _, path = args.data.partition(":")
    if kind == "synthetic":
        from embark_jax.data.synthetic import SyntheticDataset

        ds = SyntheticDataset(
            full if dynamic else config,
            batch_size=args.batch_size,
            seed=args.seed,
            dynamic_features=[f.name for f in dynamic.features] if dynamic else (),
        )
        return ds, [ds.batch(10**7 + i) for i in range(args.eval_batches)]
    from embark_jax.data.batch import DataError
    from embark_jax.data.criteo import CriteoMultiHot, CriteoTSV

    reader = CriteoTSV if kind == "criteo-tsv" else CriteoMultiHot
    try:
        ds = reader(
            path,
            config,
            batch_size=args.batch_size,
            process_index=jax.process_index(),
            process_count=jax.process_count(),
            dynamic=dynamic,
            columns=[f.name for f in full.features] if dynamic else None,
        )
    except (OSError, ValueError) as e:
        raise CLIError(f"--data {args.data}: {e}") from None
    say(f"data: {ds.num_samples} samples from {args.data}; {ds.describe_bad_rows()}")
    held = args.eval_batches * args.batch_size
    try:
        if ds.num_samples >= 2 * held:
            train, held_out = ds.split(held)
            say(f"evaluating on the last {held} samples (held out from training)")
            evals = [held_out.batch(i) for i in range(args.eval_batches)]
            held_out.close()
            return train, evals
        say(f"only {ds.num_samples} samples: evaluating on training samples (nothing held out)")
        return ds, [ds.batch(i) for i in range(args.eval_batches)]
    except DataError as e:
        raise CLIError(_data_error(args, "evaluation batches", e)) from None


def _schedule_text(schedule) -> str:
    return ",".join(f"{k}={getattr(schedule, k)}" for k in ("warmup", "decay_start", "decay_steps"))


def _sparse_optimizer(name: str, lr, schedule=None):
    """The sparse optimizer `name` at rate `lr`, or under `schedule` (`--lr-schedule`)."""
    from embark_jax.ops import optimizers as O

    return {
        "sgd": O.SGD,
        "adagrad": O.Adagrad,
        "rowwise_adagrad": O.RowWiseAdagrad,
        "adam": O.Adam,
    }[name](learning_rate=schedule(lr) if schedule else lr)


def _model_spec(args):
    """The preset, capped as asked, priced with the sparse optimizer that will train it."""
    from embark_jax.planner import load_preset

    spec = load_preset(args.model)
    footprint = _sparse_optimizer(args.optimizer, args.lr).slot_footprint
    tables = []
    for t in spec.tables:
        v = min(t.vocab_size, args.max_vocab) if args.max_vocab else t.vocab_size
        h = min(t.hotness, args.max_hotness) if args.max_hotness else t.hotness
        tables.append(dataclasses.replace(t, vocab_size=v, hotness=h))
    return dataclasses.replace(spec, tables=tuple(tables), slot_footprint=footprint)


def _broadcast_text(text: str) -> str:
    """Process 0's `text` on every process."""
    import numpy as np
    from jax.experimental import multihost_utils

    data = np.frombuffer(text.encode(), np.uint8)
    n = int(multihost_utils.broadcast_one_to_all(np.int32(data.size)))
    buf = np.zeros(n, np.uint8)
    buf[: min(n, data.size)] = data[:n]
    return bytes(np.asarray(multihost_utils.broadcast_one_to_all(buf))).decode()


def _choose_plan(args, spec, hw, plan_file):
    from embark_jax.planner import baseline, evaluate, plan

    if plan_file is not None:
        return evaluate(spec, plan_file, hw)
    if args.baseline:
        return baseline(spec, args.batch_size, hw, args.baseline)
    return plan(spec, args.batch_size, hw)


def _agree_on_plan(ev, spec, hw):
    """Every process must run the same plan: process 0's (each host may calibrate
    differently) is broadcast to the others."""
    import jax

    from embark_jax.core.plan import Plan
    from embark_jax.planner import evaluate

    if jax.process_count() == 1:
        return ev
    agreed = _broadcast_text(ev.plan.to_json(indent=None))
    if agreed != ev.plan.to_json(indent=None):
        ev = evaluate(spec, Plan.from_json(agreed), hw)
    return ev


def _agree_on_dynamic(dynamic):
    """Every process must place the dynamic tables alike: process 0's placements and
    capacities (chosen on its calibration) are broadcast to the others."""
    import jax

    if dynamic is None or jax.process_count() == 1:
        return dynamic
    mine = {"replicated": list(dynamic.replicated)}
    mine["capacity"] = {t.name: t.capacity for t in dynamic.tables}
    agreed = json.loads(_broadcast_text(json.dumps(mine, sort_keys=True)))
    tables = tuple(
        dataclasses.replace(t, capacity=agreed["capacity"][t.name]) for t in dynamic.tables
    )
    return dataclasses.replace(dynamic, tables=tables, replicated=tuple(agreed["replicated"]))


def _build(args, config, plan, dynamic=None):
    """The setup, initial state and step runner for the chosen plan."""
    import optax

    from embark_jax.core.options import RuntimeOptions
    from embark_jax.training import state as train_state
    from embark_jax.training.models import DenseConfig
    from embark_jax.training.runner import StepRunner

    dense = (
        DenseConfig.mini(args.model_kind)
        if args.dense_net == "mini"
        else DenseConfig(kind=args.model_kind)
    )
    if args.model_kind == "dlrm":
        dense = _dlrm_bottom(dense, config)
    if args.mixed_precision:
        dense = dataclasses.replace(dense, dtype="bfloat16")
    options = RuntimeOptions(
        comm_dtype="bfloat16" if args.mixed_precision else "table",
        overflow=args.overflow_policy,
    )
    setup, state = train_state.create(
        config,
        plan,
        dense=dense,
        sparse_optimizer=_sparse_optimizer(args.optimizer, args.lr, args.lr_schedule),
        dense_optimizer=optax.adam(
            args.lr_schedule(args.dense_lr) if args.lr_schedule else args.dense_lr
        ),
        seed=args.seed,
        options=options,
        dynamic=dynamic,
    )
    return StepRunner(setup), state


def _dlrm_bottom(dense, config):
    """DLRM's dot interaction needs the bottom MLP's output dim to equal every embedding's
    dim: the bottom MLP's last layer takes the tables' common dim (one error line if the
    tables have several)."""
    dims = sorted({t.dim for t in config.tables})
    if len(dims) != 1:
        raise CLIError(
            f"--model-kind dlrm needs every table of one dim (its dot interaction); this "
            f"model has dims {dims}: use --model-kind dcnv2"
        )
    return dataclasses.replace(dense, bottom=(*dense.bottom[:-1], dims[0]))


def _maybe_resume(args, runner, state, say):
    """The restored state and data position, or the given ones when not resuming."""
    from embark_jax.training import checkpoint

    if not args.resume:
        return state, 0
    with warnings.catch_warnings(record=True) as caught:  # a damaged newest step: one line
        warnings.simplefilter("always", UserWarning)
        latest = checkpoint.latest_step(args.checkpoint_dir)
        if latest is not None:
            try:
                state, meta = checkpoint.restore(args.checkpoint_dir, runner.setup)
            except (ValueError, OSError) as e:  # a mismatch or a damaged checkpoint
                raise CLIError(f"--resume from {args.checkpoint_dir}: {e}") from None
    for text in dict.fromkeys(str(w.message) for w in caught):
        say(f"warning: {text}")
    if latest is None:
        say(f"no checkpoint in {args.checkpoint_dir}: starting from scratch")
        return state, 0
    start = meta["data_position"]
    say(
        f"resumed from {meta['path']} (step {meta['step']}, saved with "
        f"{meta['plan'].topology.num_devices} devices); continuing at batch {start}"
    )
    return state, start


def _callbacks(args, runner, start, lead):
    from embark_jax.training.callbacks import ExitAtStep, Progress
    from embark_jax.training.checkpoint import CheckpointEvery

    cbs, loggers = [], []
    if args.debug_exit_at:
        proc, at = (int(x) for x in args.debug_exit_at.split(":"))
        cbs.append(ExitAtStep(proc, at))
    if lead:
        cbs.append(Progress(runner, args.steps, args.batch_size, start, args.log_every, sys.stdout))
    if args.checkpoint_dir:
        import jax

        try:  # CheckpointEvery checks the directory is writable (checked before JAX too)
            saver = CheckpointEvery(
                args.checkpoint_dir,
                runner,
                args.save_every,
                start + args.steps,
                async_save=args.async_checkpoint and jax.process_count() == 1,
            )
        except PermissionError as e:
            raise CLIError(f"--checkpoint-dir: {e}") from None
        cbs.append(saver)
    if lead and args.log_dir:
        from embark_jax.training.callbacks import JsonLinesLogger, TensorBoardLogger

        jsonl = os.path.join(args.log_dir, "metrics.jsonl")
        loggers = [
            JsonLinesLogger(jsonl, runner, args.batch_size, args.log_every),
            TensorBoardLogger(args.log_dir, runner, args.batch_size, args.log_every),
        ]
    return cbs + loggers, loggers


def _prepare(args):
    """Devices, checks, model and plan: everything that can fail on a user mistake, before
    anything is written. Returns (multi, g, spec, evaluation, say, lead, full spec,
    dynamic): `spec` is the preset's fixed part (all of it without --dynamic-tables)."""
    from embark_jax.training.distributed import initialize_from_env

    plan_file = check_args(args, DEFAULT_BATCH)
    multi = initialize_from_env(default_cpu_devices=args.devices)
    import jax

    from embark_jax.cli.plan import plan_notes
    from embark_jax.core.plan import PlanError
    from embark_jax.planner import get_hardware, report

    lead = jax.process_index() == 0
    say = print if lead else (lambda *a, **k: None)
    g = len(jax.devices())
    check_devices(args, g, plan_file)
    full = _model_spec(args)
    topology = args.topology or ("h200" if jax.default_backend() == "gpu" else "local")
    hw = get_hardware(topology, args.nodes, g // args.nodes)
    spec, dynamic, _, choices = train_dynamic.split(args, full, hw)
    dynamic = _agree_on_dynamic(dynamic)
    if plan_file is not None:
        try:
            plan_file.validate(spec.embedding_config())
        except PlanError as e:
            raise CLIError(f"--plan {args.plan!r} does not fit --model {args.model}: {e}") from None
    ev = _agree_on_plan(_choose_plan(args, spec, hw, plan_file), spec, hw)
    say(report.summary(ev, max_tables=12, max_devices=8).rstrip("\n"))
    hint = None if args.plan_out else "--plan-out plan.json"
    for line in plan_notes(ev, None, out_flag=hint, max_tables=12):
        say(line)
    if dynamic is not None:
        for line in train_dynamic.describe(dynamic, choices, g):
            say(line)
    return multi, g, spec, ev, say, lead, full, dynamic


class _Position:
    """The fit loop's position, for the messages of a run that stops early: `running` is
    the data position of the step under way (or last begun), `done` the steps finished."""

    def __init__(self, start: int):
        self.running, self.done = start, 0

    def on_step_start(self, step: int) -> None:
        self.running = step

    def on_step_end(self, step, state, result) -> None:
        self.done += 1

    def on_end(self, state) -> None:
        pass


class _Interrupted(KeyboardInterrupt):
    """Ctrl-C taken at a step boundary: the steps before it, and their saves, are done."""


class _StopAtStepBoundary:
    """A fit callback that turns the first Ctrl-C into a stop before the next step, so the
    step under way and its checkpoint finish (a `KeyboardInterrupt` in the middle of a save
    left Orbax's writer threads failing at exit); a second Ctrl-C stops at once. With
    several processes Ctrl-C stops at once: they could otherwise stop at different steps
    and wait on each other's collectives."""

    def __init__(self, enabled: bool):
        self.requested = False
        self._old = None
        if enabled and threading.current_thread() is threading.main_thread():
            self._old = signal.signal(signal.SIGINT, self._handler)

    def _handler(self, signum, frame) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True
        print(
            "stopping after the step under way (Ctrl-C again to stop at once)",
            file=sys.stderr,
            flush=True,
        )

    def restore(self) -> None:
        if self._old is not None:
            signal.signal(signal.SIGINT, self._old)
            self._old = None

    def on_step_start(self, step: int) -> None:
        if self.requested:
            raise _Interrupted

    def on_step_end(self, step, state, result) -> None:
        pass

    def on_end(self, state) -> None:
        pass


def _check_first_batch(args, runner, ds, start: int) -> None:
    """Reads and checks the first training batch before anything is written, so that data
    the model cannot take fails the command with nothing left behind."""
    from embark_jax.data.batch import DataError

    try:
        runner.check_batch(ds.batch(start))
    except DataError as e:
        raise CLIError(_data_error(args, f"batch {start}", e)) from None


def _data_error(args, where: str, e: Exception) -> str:
    """A data error's line: the readers' messages name their source, others get --data."""
    source = "" if str(e).startswith(args.data.partition(":")[0]) else f"--data {args.data}: "
    return f"{where}: {source}{e}"


def _resume_command(args) -> str:
    argv = list(getattr(args, "argv", None) or sys.argv[1:])
    if "--resume" not in argv:
        argv.append("--resume")
    return shlex.join([os.path.basename(sys.executable), "-m", "embark_jax", *argv])


def _interrupted(args, position: _Position, start: int, callbacks) -> int:
    """One line on stderr for a Ctrl-C during training: the last step done, the last
    complete checkpoint and the command that resumes; exit code 130 (128 + SIGINT)."""
    from embark_jax.training.checkpoint import CheckpointEvery

    for cb in callbacks:  # an asynchronous save in flight completes; logs are flushed
        try:
            if isinstance(cb, CheckpointEvery):
                cb.wait()
            elif hasattr(cb, "close"):
                cb.close()
        except Exception:  # a failed save: the last complete checkpoint is reported below
            pass
    step = start + position.done
    if not args.checkpoint_dir:
        tail = "no checkpoint saved (no --checkpoint-dir); a rerun starts over"
    else:
        from embark_jax.training.checkpoint_dir import latest_step

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            last = latest_step(args.checkpoint_dir)
        saved = f"step {last}" if last is not None else "none yet"
        tail = (
            f"last checkpoint {saved} in {args.checkpoint_dir}; resume with: "
            f"{_resume_command(args)}"
        )
    try:
        sys.stdout.flush()
    except (OSError, ValueError):
        pass
    print(f"interrupted at step {step}; {tail}", file=sys.stderr, flush=True)
    return INTERRUPTED


def run_train(args) -> int:
    multi, g, spec, ev, say, lead, full, dynamic = _prepare(args)
    import jax

    from embark_jax.data.batch import DataError
    from embark_jax.training.loop import fit

    config = spec.embedding_config()
    ds, eval_batches = _datasets(args, config, say, dynamic, full.embedding_config())
    runner, state = _build(args, config, ev.plan, dynamic)
    state, start = _maybe_resume(args, runner, state, say)
    _check_first_batch(args, runner, ds, start)
    if lead and args.plan_out:
        ev.plan.to_json(make_parent(args.plan_out))
        say(f"wrote {args.plan_out}")
    say(
        f"training {args.steps} steps, global batch {args.batch_size}, {g} devices on "
        f"{jax.process_count()} process(es), sparse {args.optimizer} lr {args.lr}"
        + (f" under --lr-schedule {_schedule_text(args.lr_schedule)}" if args.lr_schedule else "")
    )
    t0 = time.perf_counter()
    callbacks, loggers = _callbacks(args, runner, start, lead)
    position = _Position(start)
    stopper = _StopAtStepBoundary(enabled=jax.process_count() == 1)
    try:
        state, summary = fit(
            runner,
            state,
            ds,
            args.steps,
            start=start,
            callbacks=[position, stopper, *callbacks],
        )
        ev_metrics = runner.evaluate(state, eval_batches)
    except DataError as e:  # a bad value met during training: one line, nothing applied
        where = f"batch {position.running} (step {position.running + 1})"
        raise CLIError(_data_error(args, where, e)) from None
    except KeyboardInterrupt:
        stopper.restore()
        if hasattr(ds, "close"):
            ds.close()
        return _interrupted(args, position, start, callbacks)
    finally:
        stopper.restore()
    for logger in loggers:
        prefix = "eval/" if hasattr(logger, "writer") else "eval_"
        logger.log_scalars(
            start + args.steps,
            {f"{prefix}auc": ev_metrics["auc"], f"{prefix}logloss": ev_metrics["logloss"]},
        )
        logger.close()
    result = {
        "model": args.model,
        "data": args.data,
        "bad_rows": dict(getattr(ds, "bad_rows", {})),
        "devices": g,
        "processes": jax.process_count(),
        "multi_process": multi,
        "plan": ev.name,
        "steps": args.steps,
        "batch_size": args.batch_size,
        "optimizer": args.optimizer,
        "eval_auc": ev_metrics["auc"],
        "eval_logloss": ev_metrics["logloss"],
        "train_auc": summary.train_auc,  # cumulative over all steps of this run
        "train_logloss": summary.train_logloss,
        "samples_per_s": summary.samples_per_s,
        "wall_s": time.perf_counter() - t0,
        "overflow": summary.overflow,
        "dynamic": summary.dynamic,
        "invalid_ids": summary.invalid,
        "comm_bytes_per_step": runner.comm_bytes_per_step(state, ds.batch(0)),
        "predicted_step_ms": ev.step_s * 1e3,
        "losses": summary.losses,
    }
    if hasattr(ds, "close"):
        ds.close()
    _report(result, say)
    if lead and args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as fh:
            json.dump(result, fh, indent=1)
        say(f"wrote {args.out}")
    if lead and args.log_dir:
        say(f"wrote per-step metrics to {args.log_dir} (metrics.jsonl, TensorBoard events)")
    return 0


def _report(result, say) -> None:
    say(
        f"eval logloss {result['eval_logloss']:.4f}  eval AUC {result['eval_auc']:.4f}  "
        f"train AUC (cumulative, all {result['steps']} steps) {result['train_auc']:.4f}  "
        f"throughput {result['samples_per_s']:.0f} samples/s  overflow "
        f"{sum(result['overflow'].values())} ids  collectives "
        f"{result['comm_bytes_per_step']['total'] / 1e6:.2f} MB/step per device"
    )
    for name, counts in result["dynamic"].items():
        say(f"dynamic table {name}: " + ", ".join(f"{k} {v}" for k, v in counts.items()))
