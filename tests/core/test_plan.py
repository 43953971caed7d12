"""Plan JSON is read strictly: no truncation, no ignored keys, text and files kept apart."""

import json

import pytest

from embark_jax.core.plan import Plan, PlanError, TablePlan, Topology

PLAN = Plan(
    topology=Topology(num_nodes=1, devices_per_node=2),
    batch_size=4,
    tables=(
        TablePlan(name="a", cluster="rb", row_shards=2, column_shards=1, devices=((0, 1),)),
        TablePlan(
            name="b",
            cluster="ub",
            row_shards=1,
            column_shards=1,
            devices=((1,),),
            capacity_factor=2.0,
            unique_capacity=8,
        ),
    ),
)


def _mutated(fn) -> str:
    d = json.loads(PLAN.to_json())
    fn(d)
    return json.dumps(d)


def test_round_trip_text_and_file(tmp_path):
    assert Plan.from_json(PLAN.to_json()) == PLAN
    path = tmp_path / "p.json"
    PLAN.to_json(str(path))
    assert Plan.from_file(str(path)) == PLAN and Plan.from_file(path) == PLAN


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda d: d["tables"][0].update(row_shards=2.7), "table 'a': row_shards must be an int"),
        (lambda d: d["tables"][0].update(row_shards=2.0), "table 'a': row_shards must be an int"),
        (lambda d: d.update(batch_size=16.9), "batch_size must be an integer, got 16.9"),
        (lambda d: d["tables"][0].update(devices=[[0, 1.9]]), "table 'a': device must be an int"),
        (lambda d: d["tables"][0].update(devices=[[0, True]]), "table 'a': device must be an int"),
        (lambda d: d["tables"][0].update(devices=[0, 1]), "table 'a': devices must be a list of"),
        (
            lambda d: d["tables"][1].update(capacity_factr=2.0),
            "table 'b': unknown field 'capacity_",
        ),
        (lambda d: d["tables"][1].update(capacity_factor=float("inf")), "table 'b': capacity_fac"),
        (lambda d: d["tables"][1].update(capacity_factor=float("nan")), "table 'b': capacity_fac"),
        (lambda d: d["tables"][1].update(capacity_factor="2"), "table 'b': capacity_factor must"),
        (lambda d: d["tables"][1].update(unique_capacity=3.5), "table 'b': unique_capacity must"),
        (lambda d: d["topology"].update(num_nodes=True), "topology num_nodes must be an integer"),
        (lambda d: d["topology"].update(nodes=1), "plan topology: unknown field 'nodes'"),
        (lambda d: d.update(batchsize=4), "plan: unknown field 'batchsize'"),
        (lambda d: d["tables"][0].pop("cluster"), "table 'a': missing field 'cluster'"),
        (lambda d: d["tables"][0].update(name=3), "table name must be a non-empty string"),
        (lambda d: d.update(tables={"a": 1}), "plan tables must be a list"),
        (lambda d: d["tables"][0].update(cluster="xx"), "table 'a': unknown cluster 'xx'"),
        (lambda d: d["tables"][0].update(column_shards=0), "table 'a': column_shards must be >= 1"),
        (
            lambda d: d["tables"][0].update(row_shards=-2),
            "table 'a': row_shards must be >= 1, got -2",
        ),
        (lambda d: d.update(batch_size=2**31 + 8), "batch_size 2147483656 is above 2147483647"),
    ],
)
def test_bad_fields_name_the_table_and_field(mutate, message):
    with pytest.raises(PlanError, match=message):
        Plan.from_json(_mutated(mutate))


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[1, 2]", "a plan must be a JSON object, got list"),
        ("{bad", "plan is not valid JSON"),
        ("", "plan is not valid JSON"),
        ("plan.json", "plan is not valid JSON"),  # text is never taken for a path
    ],
)
def test_from_json_takes_text_only(text, message):
    with pytest.raises(PlanError, match=message):
        Plan.from_json(text)


@pytest.mark.parametrize(
    ("old", "new", "message"),
    [
        (
            '"batch_size": 4',
            '"batch_size": 16, "batch_size": 24',
            "'batch_size' is given twice in the plan",
        ),
        (
            '"num_nodes": 1',
            '"num_nodes": 1, "num_nodes": 2',
            "'num_nodes' is given twice in the plan topology",
        ),
        (
            '"row_shards": 2',
            '"row_shards": 2, "row_shards": 1',
            "'row_shards' is given twice in table 'a'",
        ),
    ],
)
def test_a_key_given_twice_is_refused(old, new, message):
    text = PLAN.to_json(indent=None)
    assert old in text
    with pytest.raises(PlanError, match=message):
        Plan.from_json(text.replace(old, new, 1))


def test_from_file_names_the_file(tmp_path):
    with pytest.raises(PlanError, match=r"cannot read plan file .*missing\.json.*No such file"):
        Plan.from_file(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text('{"format": ')
    with pytest.raises(PlanError, match=r"plan file .*bad\.json.*not valid JSON"):
        Plan.from_file(bad)


def test_constructor_is_strict_too():
    with pytest.raises(PlanError, match=r"table 'a': device must be an integer, got 1\.5"):
        TablePlan(name="a", cluster="rb", row_shards=1, column_shards=1, devices=((1.5,),))
    with pytest.raises(PlanError, match="batch_size must be an integer"):
        Plan(topology=Topology(), batch_size=8.0, tables=())


def test_make_mesh_says_how_to_get_fake_devices():
    big = Plan(topology=Topology(num_nodes=1, devices_per_node=64), batch_size=64, tables=())
    with pytest.raises(PlanError, match=r"jax_num_cpu_devices\", 64\)"):
        big.make_mesh()
