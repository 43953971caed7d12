"""embark_jax's contenders, on one CPU device (imported only in an embark worker).

- `embark`: `lookup_fn` + `apply_gradients_fn` in one `jax.jit`, the tables, optimizer
  slots and staging memory (`init_staging`) donated (updated in place), the output gradients given; the planner's plan for one
  device (`embark_jax.planner.plan`, the machine's calibration, its whole memory).
- `embark_tuned`: the `embark` step in a process with the kernels' opt-in tuning
  (`EMBARK_CPU_TUNING=on`, set by the driver).
- `embark_rb`: the same step with every table RB on device 0 (on one device DP, RB and UB
  are all local, but they run different code).
- `embark_collection`: `EmbeddingCollection.lookup` + `apply_gradients` with the planner's
  plan, the way an interactive user calls them (each a jitted call; `apply_gradients`
  checks its `applied` flag on the host, so a step waits for the one before).

The state comes from the public constructors (`train_state.create`, `EmbeddingCollection`),
then every group buffer is replaced by the inputs' tables (`Lowered.stack`), one group at a
time. Row-wise Adagrad with TBE's learning rate and eps.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import time

import jax
import numpy as np

from experiments.collection.data import Inputs, embedding_config

KINDS = ("embark", "embark_tuned", "embark_rb", "embark_collection")


def planner_plan(config, batch: int):
    """The planner's plan for this machine as one device (all its memory)."""
    from embark_jax.ops.optimizers import RowWiseAdagrad
    from embark_jax.planner import ModelSpec, calibrate_local, plan

    spec = ModelSpec.from_config(config, RowWiseAdagrad(learning_rate=0.01).slot_footprint)
    memory = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    hw = dataclasses.replace(calibrate_local().with_shape(1, 1), memory_bytes=float(memory))
    return plan(spec, batch, hw).plan


def every_table_rb(config, batch: int):
    import embark_jax as ej

    tables = tuple(
        ej.TablePlan(name=t.name, cluster="rb", row_shards=1, column_shards=1, devices=((0,),))
        for t in config.tables
    )
    return ej.Plan(
        topology=ej.Topology(num_nodes=1, devices_per_node=1), batch_size=batch, tables=tables
    )


def _zeros(key, shape, dtype=np.float32) -> np.ndarray:
    return np.zeros(shape, dtype)


def _stacked(lowered, inp: Inputs, group) -> np.ndarray:
    index = {t.name: i for i, t in enumerate(inp.workload.tables)}
    return lowered.stack({name: inp.table(index[name]) for name in group.tables}, group)


class EmbarkContender:
    def __init__(self, kind: str, inp: Inputs):
        from embark_jax.data.sparse import SparseFeatures
        from embark_jax.ops.optimizers import RowWiseAdagrad

        if kind not in KINDS:
            raise ValueError(f"unknown embark contender {kind!r}")
        self.kind, self.inp = kind, inp
        w = inp.workload
        # the tables start as zeros (cheap), then each group buffer is replaced by the inputs'
        self.config = embedding_config(w, initializer=_zeros)
        plan = (every_table_rb if kind == "embark_rb" else planner_plan)(self.config, w.batch)
        self.clusters = dict(collections.Counter(t.cluster.value for t in plan.tables))
        opt = RowWiseAdagrad(learning_rate=inp.learning_rate, eps=inp.eps)
        host = [
            SparseFeatures.from_dense(
                {w.feature(t): inp.batch_ids(k, i) for i, t in enumerate(w.tables)},
                config=self.config,
            )
            for k in range(inp.batches)
        ]
        grads = {w.feature(t): inp.grad(i) for i, t in enumerate(w.tables)}
        if kind == "embark_collection":
            self._build_collection(plan, opt, host, grads)
        else:
            self._build_step(plan, opt, host, grads)
        self.i = 0
        self.last = None

    # --- construction ------------------------------------------------------------------

    def _build_step(self, plan, opt, host, grads):
        from embark_jax.sharding.collection import apply_gradients_fn, init_staging, lookup_fn
        from embark_jax.training import state as train_state
        from embark_jax.training.models import DenseConfig

        setup, state = train_state.create(
            self.config, plan, dense=DenseConfig.mini(), sparse_optimizer=opt, num_dense=1
        )
        self.setup, sharding = setup, setup.table_sharding
        tables = dict(state.tables)
        del state
        for group in setup.lowered.groups:  # one group at a time: one extra copy at most
            tables[group.name].delete()
            tables[group.name] = jax.device_put(_stacked(setup.lowered, self.inp, group), sharding)
        self.tables = tables
        self.slots = train_state.init_slots(setup, tables)
        self.batches = [jax.device_put(b, sharding) for b in host]
        self.grads = jax.device_put(grads, sharding)
        lowered, mesh, options, optimizers = (
            setup.lowered,
            setup.mesh,
            setup.options,
            setup.optimizers,
        )

        self.staging = init_staging(
            lowered, mesh, options, self.tables, self.slots, optimizers, self.batches[0]
        )

        def step(tables, slots, staging, batch, grads):
            outputs, residuals, overflow = lookup_fn(lowered, mesh, options, tables, batch)
            tables, slots, applied, staging = apply_gradients_fn(
                lowered,
                mesh,
                options,
                tables,
                slots,
                residuals,
                grads,
                optimizers,
                batch,
                staging=staging,
            )
            return tables, slots, staging, outputs, overflow, applied

        self.step_fn = jax.jit(step, donate_argnums=(0, 1, 2))

    def _build_collection(self, plan, opt, host, grads):
        from flax import nnx

        import embark_jax as ej

        coll = ej.EmbeddingCollection(
            self.config, plan, plan.make_mesh(), rngs=nnx.Rngs(0), optimizer=opt
        )
        sharding = coll.lowered.sharding(coll.mesh)
        for group in coll.lowered.groups:
            coll.buffers[group.name].get_value().delete()
            coll.buffers[group.name].set_value(
                jax.device_put(_stacked(coll.lowered, self.inp, group), sharding)
            )
        self.coll = coll
        self.batches = [coll.shard_batch(b) for b in host]
        self.grads = jax.device_put(grads, sharding)

    # --- steps -------------------------------------------------------------------------

    def one(self):
        """One step on the next batch; returns (outputs, overflow [tables], applied)."""
        batch = self.batches[self.i % len(self.batches)]
        self.i += 1
        if self.kind == "embark_collection":
            res = self.coll.lookup(batch)
            applied = self.coll.apply_gradients(res, self.grads)
            self.last = res.outputs
            return res.outputs, list(res.overflow.values()), applied
        self.tables, self.slots, self.staging, outputs, overflow, applied = self.step_fn(
            self.tables, self.slots, self.staging, batch, self.grads
        )
        self.last = outputs
        return outputs, overflow, applied

    def sync(self) -> None:
        if self.kind == "embark_collection":
            jax.block_until_ready((self.last, self.coll.buffer_values()))
        else:
            jax.block_until_ready((self.last, self.tables, self.slots))

    def sampled_rows(self) -> dict[str, np.ndarray]:
        """Table name -> the inputs' sampled rows of it, now. Gathered one group at a time
        (`Lowered.unstack` of that group alone), so that at most one group's tables are
        copied to the host at once."""
        if self.kind == "embark_collection":
            lowered, buffers = self.coll.lowered, self.coll.buffer_values()
        else:
            lowered, buffers = self.setup.lowered, self.tables
        index = {t.name: i for i, t in enumerate(self.inp.workload.tables)}
        out = {}
        for group in lowered.groups:
            alone = dataclasses.replace(lowered, groups=(group,))
            tables = alone.unstack({group.name: np.asarray(buffers[group.name])})
            for name, table in tables.items():
                out[name] = table[self.inp.sample_rows(index[name])]
            del tables
        return out

    def check(self, out_dir: str) -> dict:
        """Step 1 on batch 0: writes each feature's output and each table's sampled rows
        after the update (`out_I.npy`, `rows_I.npy`)."""
        w = self.inp.workload
        t0 = time.perf_counter()
        outputs, overflow, applied = self.one()
        self.sync()
        first_step_s = time.perf_counter() - t0
        for i, t in enumerate(w.tables):
            np.save(os.path.join(out_dir, f"out_{i}.npy"), np.asarray(outputs[w.feature(t)]))
        rows = self.sampled_rows()
        for i, t in enumerate(w.tables):
            np.save(os.path.join(out_dir, f"rows_{i}.npy"), rows[t.name])
        return {
            "overflow": int(sum(np.sum(np.asarray(v)) for v in jax.tree.leaves(overflow))),
            "applied": bool(np.asarray(applied)),
            "clusters": self.clusters,
            "first_step_s": first_step_s,
        }

    def settle(self) -> dict | None:
        """Waits (at most 300 s) until the kernels' background thread has put the tables it
        was given on huge pages (EMBARK_HUGEPAGES, on by default); what it did, or None when
        the mode is off."""
        from embark_jax.ops import native

        if native.huge_page_mode() != "auto":
            return None
        done = native.wait_huge_pages(300.0)
        return {"done": done, **native.huge_page_stats()}

    def info(self) -> dict:
        import jaxlib

        from embark_jax.ops import native

        return {
            "jax": jax.__version__,
            "jaxlib": jaxlib.__version__,
            "backend": jax.default_backend(),
            "devices": len(jax.devices()),
            "embark_build": {k: str(v) for k, v in native.build_info().items()},
        }
