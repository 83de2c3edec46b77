"""`hkstore levels profile STORE TENANT --dev FILE`: Tabi's calibration and profiling for one tenant.

The temperatures of both levels are fitted on --calibration (labelled text the tenant did not
train on; default: --dev), the dispatch policy (c, k, alpha, w, coverage gate) is chosen on --dev
for --target, and the record is stored in the tenant's PET meta, where `runtime.infer` and the
server read it (policy "auto"). Level 1 is the PLOT, or, for a tenant with complete, current students, its
students when a cascade from them meets --target at less cost (students first; the record
keeps the best PLOT-first policy for when the students go stale). A record is made for one PET: after `tenant update` it is stale
and ignored (level 1 answers) until the tenant is profiled again, so run this after every
create or update that should serve with levels. Level 2 is the tenant's top: its current
full-depth PET when it has one, else the full-context lower layers (exact); the record names
the top it was profiled against, and a tenant whose top changed since (a full-depth PET added,
retrained or removed) is served as unprofiled until it is profiled again.

Each current level whose precision was asked auto at tenant create is measured again on --dev
(runtime.construct.precision): bf16 where it scores at most --target (when given; else 0.3
points) below fp32, and its record rewritten.
"""

import json

import click


@click.group("levels")
def levels():
    """Multi-level inference (Tabi): calibrate and profile a tenant's levels."""


@levels.command("profile")
@click.argument("store")
@click.argument("tenant")
@click.option("--dev", "dev_path", required=True, type=click.Path(exists=True, dir_okay=False),
              help="Labelled validation text (the tenant's format): the policy is chosen on it.")
@click.option("--calibration", "calibration_path", type=click.Path(exists=True, dir_okay=False),
              help="Labelled text the tenant did not train on, for the temperatures (default: --dev).")
@click.option("--target", type=click.FloatRange(0, 100), default=None,
              help="Points of accuracy / F1 the tenant may lose against level 2 [default: 0.5], and each level "
                   "at bf16 against fp32 [default: 0.3].")
@click.option("--assurance", type=click.FloatRange(0, 1, max_open=True), default=None,
              help="Share of bootstrap resamples of --dev in which the policy must stay within --target "
                   "[default: runtime.level.profile.ASSURANCE], its choice also checked on the queries each "
                   "resample left out; 0: the cheapest within it on --dev as it is.")
@click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]), default="auto", show_default=True)
@click.option("--json", "as_json", is_flag=True,
              help="Print the stored record as JSON (with each measured level's precision under precision).")
def profile(store, tenant, dev_path, calibration_path, target, assurance, device, as_json):
    """Fit TENANT's level temperatures and choose its dispatch policy; store both with its PET."""
    import runtime
    from runtime.level.profile import ASSURANCE, bar_words, check_precision, profile_tenant

    with runtime.open(store, device=device) as rt:
        rec = profile_tenant(rt, store, tenant, dev_path, calibration_path,
                             target=(PROFILE_TARGET if target is None else target) / 100,
                             assurance=ASSURANCE if assurance is None else assurance)
    try:
        levels = check_precision(store, tenant, dev_path, None if target is None else target / 100)
    except ValueError as e:  # the dev file's labels, a tenant changed meanwhile: one line
        raise click.ClickException(str(e).strip().splitlines()[0]) from None
    if as_json:
        click.echo(json.dumps(dict(rec, precision=levels), indent=1, sort_keys=True))
        return
    p, pr = rec["policy"], rec["profile"]
    click.echo(f"{tenant}: level 2 is {pr['top']}; temperature level 1 {rec['temperature']['1']:.3g}, "
               f"level 2 {rec['temperature']['2']:.3g}")
    alone = (f"students {100 * pr['students_metric']:.1f} at cost {pr['students_cost']:.2f}, "
             if "students_metric" in pr else "")
    click.echo(f"  level 1 {_first(p)}; policy c={p['c']:g} k={p['k']:g} alpha={p['alpha']:g} w={p['w']:g} "
               f"gate={p['gate']:g}")
    click.echo(f"  expected on dev: metric {100 * pr['expected_metric']:.1f} (plot {100 * pr['level1_metric']:.1f} "
               f"at cost {pr['level1_cost']:.2f}, {alone}"
               f"level 2 {100 * pr['level2_metric']:.1f}), cost {pr['expected_cost']:.2f} of level 2, "
               f"re-routed {100 * pr['expected_reroute']:.0f}%" + ("" if pr["met"] else "; target not met")
               + (f"; held in {100 * pr['assurance']:.0f}% of resamples" if pr["met"] and pr["assurance"] else ""))
    if pr.get("assurance") and "bar" in pr:
        click.echo(f"  the bar a cheaper policy had to clear on dev: {bar_words(pr['bar'], 'level 2')}")
    for name, level in levels.items():
        click.echo(f"  precision {name}: {level['words']}")


PROFILE_TARGET = 0.5  # points a cascade may lose against level 2 unless --target says


def _first(policy: dict) -> str:
    """The level 1 a policy starts from, as the summary names it (an older record's: plot)."""
    if policy.get("level1", "plot") != "students":
        return "plot"
    n = policy["students"]
    return f"students ({n} student{'s' if n != 1 else ''})"
