"""Every consumer of the two tables really reads them: each command's Job options are the
fields table's (vramplan/fields.py), each technique's flags are options of that table, and
the web's allow list, make-it-fit, the planner and search's advice follow the techniques
table (planning/techniques.py; tests/planning/test_techniques.py changes the table under them)."""

from __future__ import annotations

import shlex

import pytest
import typer

from vramplan.cli.app import app
from vramplan.fields import JOB_FIELDS
from vramplan.planning.techniques import ALLOW_NAMES, PLANNER_ALLOW, TECHNIQUES
from vramplan.web.schemas import PlanRequest

COMMANDS = typer.main.get_command(app).commands
JOB_COMMANDS = [name for name, command in COMMANDS.items()
                if any("--batch-size" in p.opts for p in command.params)]


def test_the_commands_that_run_a_job_are_the_ones_expected():
    assert set(JOB_COMMANDS) >= {"estimate", "plan", "headroom", "check", "measure"}


@pytest.mark.parametrize("name", JOB_COMMANDS)
def test_each_command_takes_every_field_of_the_table_as_the_table_says(name):
    params = {p.name: p for p in COMMANDS[name].params}
    for field in JOB_FIELDS:
        param = params[field.name]
        assert set(param.opts) == {field.option, *field.short}, field.name
        assert param.help.startswith(field.help), field.name  # help may add the default
        if param.secondary_opts:  # a boolean switch: --x / --no-x
            assert param.secondary_opts == ["--no-" + field.option[2:]], field.name


def test_each_techniques_flags_are_fields_of_the_table():
    options = {o for f in JOB_FIELDS for o in (f.option, f.written, *f.short)}
    options |= {"--no-" + f.option[2:] for f in JOB_FIELDS}
    for technique in TECHNIQUES:
        flags = [w for w in shlex.split(technique.flags) if w.startswith("-")]
        assert flags and set(flags) <= options, (technique.name, technique.flags)


def test_the_webs_allow_list_is_the_techniques():
    enum = PlanRequest.model_json_schema()["properties"]["allow"]["items"]["enum"]
    assert enum == [*ALLOW_NAMES, PLANNER_ALLOW]
    assert set(ALLOW_NAMES) == {t.allow for t in TECHNIQUES if t.allow}
