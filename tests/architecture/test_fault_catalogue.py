"""The fault catalogue (examples/fault_catalogue.py) is the one list of faults: every scenario a program injects
has exactly one entry there and every entry is a scenario some program injects; every answer belongs to a
scenario, and its culprit rule agrees with its layout.

"Injects" is read from the programs' code, not from lists derived from the catalogue: the scenario names their
code compares ``.scenario`` with (or fires by ``Injector.now``/``mark``), and the ``--scenario`` choices a job
declares. No torch: the models and jobs are parsed, not imported."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from conftest import REPO, examples_module

CAT = examples_module("fault_catalogue")
JOBS_DIR = REPO / CAT.JOBS
JOB_SCRIPTS = sorted(p.name for p in JOBS_DIR.glob("*.py") if not p.name.startswith("_"))
NO_FAULT_JOB = "none"  # a job's run with nothing injected
RUNNER_MARKS = {"ready"}  # node-signal's mark: not a fault, the runner's cue to kill or freeze the node


def of_program(program: str) -> set[str]:
    return {name for name, s in CAT.SCENARIOS.items() if s.program == program}


def acted_on(path: Path, within: str | None = None) -> set[str]:
    """The scenario names the code at ``path`` (only class ``within``, if given) acts on: compared with a
    ``.scenario`` attribute (``==``, ``in (...)``), or passed first to ``now(...)``/``mark(...)``."""
    tree: ast.AST = ast.parse(path.read_text())
    if within is not None:
        tree = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == within)
    names: set[str] = set()

    def strings(node: ast.AST) -> set[str]:
        return {c.value for c in ast.walk(node) if isinstance(c, ast.Constant) and isinstance(c.value, str)}

    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            if any(isinstance(x, ast.Attribute) and x.attr == "scenario" for x in sides):
                for x in sides:
                    if not isinstance(x, ast.Attribute):
                        names |= strings(x)
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            fn = node.func
            if (fn.attr if isinstance(fn, ast.Attribute) else getattr(fn, "id", None)) in ("now", "mark"):
                names.add(node.args[0].value)
    return names


def job_choices(path: Path) -> list[str]:
    """A job's ``--scenario`` choices: its ``SCENARIOS`` tuple, or the tuple it hands ``_common.parser``."""
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "SCENARIOS" for t in node.targets):
            return list(ast.literal_eval(node.value))
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "parser" and len(node.args) == 2:
            return list(ast.literal_eval(node.args[1]))
    raise AssertionError(f"{path.name} declares no --scenario choices")


def test_every_scenario_names_a_program_that_exists() -> None:
    programs = {CAT.INJECTOR, CAT.DDP_DEMO, *(CAT.JOBS + s for s in JOB_SCRIPTS)}
    for name, s in CAT.SCENARIOS.items():
        assert s.program in programs, (name, s.program)
        assert s.fires and s.what, name


def test_the_injector_accepts_exactly_the_catalogues_scenarios_of_it() -> None:
    fi = examples_module("fault_injection")  # imports no torch at import
    ours = of_program(CAT.INJECTOR)
    # what its code does, one catalogue entry each
    assert acted_on(REPO / "examples" / "fault_injection.py", within="Injector") == ours
    # what it accepts: each once
    accepted = [*fi.FAULTS, *fi.STRAGGLERS]
    assert len(accepted) == len(set(accepted)) and set(accepted) == ours
    for name in accepted:
        fi.Injector(name, 0, 0, 5)
    fi.Injector(None, 0, 0, 5)
    fi.Injector(fi.NO_FAULT, 0, 0, 5)
    with pytest.raises(ValueError, match="unknown scenario 'input-hnag'"):
        fi.Injector("input-hnag", 0, 0, 5)


def test_ddp_demo_acts_on_the_catalogues_scenarios_of_it_and_the_injectors() -> None:
    acted = acted_on(REPO / "examples" / "ddp_demo.py")
    injector = of_program(CAT.INJECTOR)
    # its own (the slow scenarios), and only injector scenarios besides (those it kept its own code for)
    assert acted - injector == of_program(CAT.DDP_DEMO)


@pytest.mark.parametrize("script", JOB_SCRIPTS)
def test_each_job_scenario_has_exactly_one_entry_and_back(script: str) -> None:
    path = JOBS_DIR / script
    choices = job_choices(path)
    assert len(choices) == len(set(choices)), choices
    faults = set(choices) - {NO_FAULT_JOB}
    assert faults == of_program(CAT.JOBS + script)
    assert acted_on(path) - RUNNER_MARKS == faults


def test_every_demo_answer_is_of_a_demo_scenario_and_every_demo_scenario_has_one() -> None:
    for table, program in ((CAT.FAULTS, CAT.INJECTOR), (CAT.DDP_DEMO_FAULTS, CAT.DDP_DEMO)):
        scenarios = [e.scenario for e in table.values()]
        assert sorted(scenarios) == sorted(of_program(program)), program
        for e in table.values():
            assert CAT.demo_fault(e.scenario) is e
            assert e.why and e.offline_why and e.kinds, e.scenario
            # a stuck rank is the fault rank; only a slow pipeline (no rank behind) names nobody
            assert e.culprit == "fault-rank" or (e.culprit == "none" and e.straggler), e.scenario


def test_every_class_is_a_scenario_of_its_job_and_every_job_scenario_has_a_class() -> None:
    used = set()
    for name, k in CAT.CLASSES.items():
        scenario = CAT.SCENARIOS[k.scenario]
        assert scenario.program == CAT.JOBS + k.script, name
        assert k.why and k.offline_why, name
        used.add(k.scenario)
    job_scenarios = {n for n, s in CAT.SCENARIOS.items() if s.program.startswith(CAT.JOBS)}
    assert used == job_scenarios


@pytest.mark.parametrize("name", list(CAT.CLASSES))
def test_a_class_culprit_rule_fits_its_layout(name: str) -> None:
    k = CAT.CLASSES[name]
    world = k.nodes * k.nproc
    assert all(0 <= r < world for r in (*k.ranks(), *k.truth)), (k.ranks(), k.truth)
    if k.culprit == "fault-rank":
        assert k.truth == (k.fault_rank,) and k.kinds
        assert all(k.truth_at(r) == (r,) for r in k.ranks())
    else:  # a whole node, several ranks or none: the truth does not move with the fault
        assert not k.other_ranks
    if k.culprit == "node":
        assert k.action in ("node-kill", "node-freeze") and k.nodes > k.action_node
        assert k.fault_rank in k.truth and len(k.truth) == k.nproc
    if k.culprit == "fault-ranks":
        assert "--also-ranks" in k.args and k.fault_rank in k.truth and len(k.truth) > 1
    if k.culprit == "none":
        assert k.truth == () and k.kinds == () and not k.straggler
    if k.action is not None:
        assert k.culprit == "node"
