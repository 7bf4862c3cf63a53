"""`oomdoctor check`: the CI gate on predicted peak memory."""
from __future__ import annotations

import json
import os
import sys

import click

from oomdoctor.cli.group import EXIT_OK, EXIT_PROBLEM, cli
from oomdoctor.cli.options import _die


@cli.command()
@click.option("--config", "config_path", type=click.Path(), default=None,
              help="File with [oomdoctor:NAME] case sections (default: ./setup.cfg).")
@click.option("--update", is_flag=True, help="Record the current peaks as the baseline.")
@click.option("--tolerance", default=None,
              help="Allowed growth, e.g. 2% (overrides the config's; per-case values win).")
@click.option("--format", "fmt", type=click.Choice(["text", "github"]), default="text",
              show_default=True, help="github: workflow annotations on the model files.")
@click.option("--junit-xml", type=click.Path(dir_okay=False), help="Also write JUnit XML here.")
@click.option("-j", "--jobs", type=click.IntRange(1), default=None,
              help="Worker processes (default: one per core).")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@click.option("--debug", is_flag=True, help="Show tracebacks.")
def check(config_path, update, tolerance, fmt, junit_xml, jobs, as_json, debug):
    """CI gate: fail when a configured case's predicted peak memory grew.

    \b
    oomdoctor check --update     # record oomdoctor-baseline.json, then commit it
    oomdoctor check              # in CI (CPU-only is fine)

    Exit codes: 0 passed, 1 failed (growth beyond the tolerance, budget exceeded, a case that
    cannot be estimated, a case missing from the baseline), 2 usage or configuration error.
    """
    from dataclasses import replace as dc_replace

    from oomdoctor.plans import check as check_mod
    from oomdoctor.plans import probe as probe_mod
    try:
        cfg = check_mod.load_config(config_path)
        if tolerance is not None:
            tol = check_mod._fraction(tolerance, "--tolerance")
            cfg = dc_replace(cfg, tolerance=tol, cases=tuple(
                c if c.tolerance != cfg.tolerance else dc_replace(c, tolerance=tol)
                for c in cfg.cases))
        baseline_path = os.path.join(cfg.root, cfg.baseline)
        baseline = None if update else check_mod.read_baseline(baseline_path)
    except check_mod.ConfigError as e:
        raise click.UsageError(str(e)) from e
    from oomdoctor.cli.script import script_output
    with script_output():       # a `command` case's script prints; the report is stdout's
        measured = check_mod.measure_all(cfg, jobs or probe_mod.default_jobs(),
                                         progress=lambda m: click.echo(m, err=True))
    if update:
        try:
            doc = check_mod.baseline_document(cfg, measured)
        except ValueError as e:
            _die(e, debug, EXIT_PROBLEM)
        with open(baseline_path, "w", encoding="utf-8") as f:
            f.write(check_mod.dumps_baseline(doc))
        click.echo(f"wrote {baseline_path} ({len(doc['cases'])} cases); commit it", err=True)
        baseline = doc
    result = check_mod.compare(cfg, measured, baseline)
    if junit_xml:
        with open(junit_xml, "w", encoding="utf-8") as f:
            f.write(check_mod.junit_xml(result))
    if as_json:
        click.echo(json.dumps(result.to_json(), indent=2))
    elif fmt == "github":
        click.echo(check_mod.render_github(result))
    else:
        click.echo(check_mod.render_table(result))
    sys.exit(EXIT_OK if result.passed else EXIT_PROBLEM)
