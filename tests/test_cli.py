"""The moebalance command: the quick benchmark, plan/inspect round trips and bad input."""

from __future__ import annotations

import json
import subprocess
import sys
import types

import numpy as np
import pytest
from _launches import Launch

from moebalance import Placement, Topology, imbalance, plan, step_imbalance, summary_imbalance
from moebalance.cli import main as cli
from moebalance.lab import report
from moebalance.lab.bench import planner as bench
from moebalance.lab.workloads import SKEWS


def run_cli(argv, capsys) -> tuple[int, str, str]:
    """Run ``moebalance argv`` in this process; return (exit status, stdout, stderr)."""
    try:
        rc = cli.main(list(argv))
    except SystemExit as exc:  # argparse exits on usage errors, --help and --version
        rc = exc.code
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.fixture
def loads_file(tmp_path):
    w = np.random.default_rng(0).gamma(0.6, 100.0, size=(3, 16))
    path = tmp_path / "loads.npy"
    np.save(path, w)
    return path, w


# -- bench ----------------------------------------------------------------------------------------

# One ``python -m moebalance bench --quick`` run, in the background, shared by the bench tests.
# One timed repeat: the tests read the tables' content, not the timings.
LAUNCHES = {"quick_bench": [Launch("bench --quick", [sys.executable, "-m", "moebalance", "bench",
                                                     "--quick", "--repeats", "1", "--out",
                                                     "{out}"], seconds=16)]}


@pytest.fixture
def quick_bench(launches):
    return launches.folder("bench --quick"), launches.output("bench --quick")


def test_bench_quick_writes_results_summary_and_plot(quick_bench):
    out, _ = quick_bench
    assert (out / "plot.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    summary = (out / "summary.md").read_text()
    assert "| scenario | skew | method | imbalance |" in summary and "one thread" in summary
    results = json.loads((out / "results.json").read_text())
    for key in ("cpu", "cores", "python", "numpy", "numba", "torch", "command", "timestamp"):
        assert results["machine"][key], key
    assert "--quick" in results["machine"]["command"]


def test_bench_quick_has_a_row_per_scenario_skew_and_method(quick_bench):
    out, _ = quick_bench
    rows = json.loads((out / "results.json").read_text())["rows"]
    static = {(r["scenario"], r["skew"], r["method"]) for r in rows if r["kind"] == "static"
              and r["workload"] == "synthetic"}
    for name in bench.STATIC_CLUSTERS:
        baseline = bench.baseline_method(bench.bench_cluster(name).topology(), 256, 8).name
        for skew in SKEWS:
            assert {(name, skew, "moebalance"), (name, skew, baseline),
                    (name, skew, f"{baseline} + optimal shares")} <= static
    drift = {(r["scenario"], r["drift"], r["method"]) for r in rows if r["kind"] == "drift"}
    for name in bench.DRIFT_CLUSTERS:
        for rel in bench.DRIFT_RELS:
            assert (name, rel, "moebalance") in drift
    for r in rows:
        assert r["imbalance"] >= 1.0 - 1e-9 and r["worst_layer_imbalance"] >= r["imbalance"] - 1e-9
        assert 0.0 < r["balancedness"] <= 1.0 + 1e-9 and r["plan_ms"] > 0
        if r["kind"] == "static":
            assert r["moves"] == r["num_layers"] * r["num_slots"] and r["moves_pct"] == 100.0


def test_bench_quick_compares_the_eplb_drop_in_on_homogeneous_clusters(quick_bench):
    out, _ = quick_bench
    dropin = [d for d in json.loads((out / "results.json").read_text())["dropin"]
              if d["workload"] == "synthetic"]
    assert {(d["scenario"], d["skew"]) for d in dropin} == {
        (name, skew) for name in bench.STATIC_CLUSTERS for skew in SKEWS
        if bench.eplb_layout(bench.bench_cluster(name).topology()) is not None}
    for d in dropin:
        assert d["balancedness_dropin"] >= d["balancedness_eplb"] - 1e-9 and d["speedup"] > 0


def test_bench_quick_has_the_migration_frontier_and_the_per_step_view(quick_bench):
    out, stdout = quick_bench
    results = json.loads((out / "results.json").read_text())
    assert (out / "frontier.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "Migration frontier" in stdout and "GB with optimizer" in stdout
    for name in bench.DRIFT_CLUSTERS:
        for rel in bench.DRIFT_RELS:
            points = {p["budget"]: p for p in results["frontier"]
                      if p["scenario"] == name and p["drift"] == rel}
            assert set(points) >= {"keep-old", "1%", "2%", "3%", "5%", "10%", "fresh"}
            assert points["keep-old"]["moves"] == 0
            for pct in (1, 2, 3, 5, 10):  # max_moves is a hard cap
                assert points[f"{pct}%"]["moves_pct"] <= pct + 1e-9
    for d in results["per_step"]:  # a trace ships with the package
        assert d["per_step_resplit"] <= d["per_step_static"] + 1e-9 and d["steps"] > 0


def test_bench_quick_prints_the_table_and_one_thread(quick_bench):
    _, stdout = quick_bench
    assert "one thread" in stdout
    assert "scenario" in stdout and "plan ms" in stdout and "homogeneous-320" in stdout
    # the verdict opens the output, one line per cluster, before the full tables
    assert stdout.index("Verdict:") < stdout.index("stale > re-split > re-plan") < \
        stdout.index("Full tables") < stdout.index("scenario  ")
    assert "EPLB calls over 0.5 s are timed once" in " ".join(stdout.split())


def test_options_without_a_command_go_to_bench(monkeypatch, capsys):
    seen = []
    monkeypatch.setattr(cli, "cmd_bench", lambda args: seen.append(args) or 0)
    assert run_cli(["--quick", "--out", "somewhere"], capsys)[0] == 0
    assert seen[0].quick and seen[0].out == "somewhere"


def test_bare_command_prints_help_and_starts_nothing(monkeypatch, capsys, tmp_path):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(cli, "cmd_bench", lambda args: pytest.fail("bare moebalance ran bench"))
    rc, out, _ = run_cli([], capsys)
    assert rc == 0 and "usage: moebalance" in out and "bench" in out and "plan" in out
    assert list(tmp_path.iterdir()) == []


def test_bench_prints_and_writes_a_legend_of_its_names(quick_bench):
    out, stdout = quick_bench
    summary = (out / "summary.md").read_text()
    for name in ("homogeneous-320", "uneven-288", "moebalance (fresh)", "eplb-style",
                 "eplb (hierarchical)", "duplicates", "drift P% xN"):
        assert f"  {name}: " in stdout, name
        assert f"- **{name}**: " in summary, name
    assert "plot.png: Side by side" in summary


def test_legend_names_only_what_the_rows_hold():
    rows = [bench.Row(workload="synthetic", scenario="heterogeneous", kind="static", skew="heavy",
                      method=m, imbalance=1.0, worst_layer_imbalance=1.0, balancedness=1.0,
                      moves=0, moves_pct=0, plan_ms=1.0, plan_ms_samples=[1.0], num_layers=1,
                      num_slots=1, num_devices=1) for m in ("moebalance", "eplb-style")]
    names = [name for name, _ in report.legend_entries(rows)]
    assert names == ["heterogeneous", "moebalance", "eplb-style"]
    assert "duplicates" not in report.legend_text(rows)


def test_plot_caption_is_drawn_under_the_axes():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3))
    report.add_caption(fig, report.PLANNER_PLOT_CAPTION, width=80)
    assert [t.get_text().replace("\n", " ") for t in fig.texts] == [report.PLANNER_PLOT_CAPTION]
    caption_top = fig.texts[0].get_window_extent(fig.canvas.get_renderer()).y1
    assert ax.get_window_extent().y0 > caption_top  # the axes sit above the caption
    plt.close(fig)


def test_bench_refuses_an_unwritable_out_before_any_work(tmp_path, capsys, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    monkeypatch.setattr(bench, "_synthetic_plan", lambda args: pytest.fail("work started"))
    rc, _, err = run_cli(["bench", "--quick", "--out", str(blocker / "out")], capsys)
    assert rc == 2 and "--out" in err and "choose a folder" in err and "Traceback" not in err


def test_bench_dispatch_hands_the_rest_of_the_line_to_the_dispatch_benchmark(monkeypatch, capsys):
    received = []
    fake = types.ModuleType("moebalance.lab.bench.dispatch")
    fake.main = lambda argv: received.append(argv) or 0
    monkeypatch.setitem(sys.modules, "moebalance.lab.bench.dispatch", fake)
    import moebalance.lab.bench as package

    monkeypatch.setattr(package, "dispatch", fake, raising=False)
    assert run_cli(["bench", "dispatch", "--quick", "--out", "x"], capsys)[0] == 0
    assert received == [["--quick", "--out", "x"]]


def test_bench_dispatch_missing_says_so(monkeypatch, capsys):
    import moebalance.lab.bench as benchmarks_pkg

    # Hide the module whether or not an earlier test imported it (then it is also an attribute).
    monkeypatch.setitem(sys.modules, "moebalance.lab.bench.dispatch", None)
    monkeypatch.delattr(benchmarks_pkg, "dispatch", raising=False)
    rc, _, err = run_cli(["bench", "dispatch"], capsys)
    assert rc == 2 and "dispatch benchmark" in err


def test_bench_trace_workload_without_a_trace_is_a_usage_error(capsys, tmp_path):
    rc, _, err = run_cli(["bench", "--workload", "trace", "--trace", "no-such-model",
                          "--out", str(tmp_path)], capsys)
    assert rc == 2 and "no-such-model" in err and "Traceback" not in err


def test_text_and_markdown_tables_line_up():
    cells = [["a", "1.000", "12.5"], ["longer name", "10.250", "3.0"]]
    text = report.format_text(("name", "x", "ms"), cells).splitlines()
    assert len({len(line) for line in text}) == 1  # numbers right-aligned to one width
    md = report.format_markdown(("name", "x", "ms"), cells).splitlines()
    assert md[1] == "|---|---:|---:|" and md[2] == "| a | 1.000 | 12.5 |"


# -- plan and inspect -----------------------------------------------------------------------------

def test_plan_then_inspect_round_trip(loads_file, tmp_path, capsys):
    path, w = loads_file
    out = tmp_path / "p.npz"
    rc, stdout, err = run_cli(["plan", str(path), "--devices", "4", "--slots", "5",
                               "--devices-per-node", "2", "--out", str(out)], capsys)
    assert rc == 0, err
    topo = Topology.uniform(4, 5, 2)
    p = Placement.load(out).validate(topo)
    assert (p.num_layers, p.num_slots, p.num_experts) == (3, 20, 16)
    assert f"imbalance {summary_imbalance(w, p, topo):.4f}" in stdout
    assert "60 expert copies" in stdout  # a first placement fills every slot of every layer

    rc, stdout, err = run_cli(["inspect", str(out), "--loads", str(path), "--devices", "4",
                               "--slots", "5"], capsys)
    assert rc == 0, err
    assert "3 layers, 20 slots on 4 devices, 16 experts" in stdout
    assert "5: 4" in stdout  # slots per device: four devices of five
    assert "valid: yes" in stdout
    assert f"imbalance {summary_imbalance(w, p, topo):.4f}" in stdout
    assert f"worst layer {imbalance(w, p, topo).max():.4f}" in stdout


def test_plan_with_previous_reports_moves_and_keeps_the_budget(loads_file, tmp_path, capsys):
    path, w = loads_file
    first, second = tmp_path / "a.npz", tmp_path / "b.npz"
    topo_args = ["--devices", "4", "--slots", "5"]
    assert run_cli(["plan", str(path), *topo_args, "--out", str(first)], capsys)[0] == 0
    np.save(path, w * np.random.default_rng(1).uniform(0.5, 1.5, size=w.shape))
    rc, stdout, err = run_cli(["plan", str(path), *topo_args, "--previous", str(first),
                               "--max-moves", "3", "--out", str(second)], capsys)
    assert rc == 0, err
    moved = Placement.load(second).moves_from(Placement.load(first))
    assert moved <= 3 and f"moves: {moved} expert cop" in stdout


def test_plan_grammar_of_one_layer(tmp_path, capsys):
    np.save(tmp_path / "one.npy", np.arange(1.0, 5.0)[None])
    rc, stdout, err = run_cli(["plan", str(tmp_path / "one.npy"), "--devices", "1", "--slots", "4",
                               "--out", str(tmp_path / "p.npz")], capsys)
    assert rc == 0, err
    assert "planned 1 layer x 4 experts onto 4 slots on 1 device in" in stdout


def test_plan_says_it_loaded_numba_kernels_from_the_cache(loads_file, tmp_path):
    pytest.importorskip("numba")
    path, _ = loads_file
    env = {**__import__("os").environ, "MOEBALANCE_PLANNER": "numba"}
    lines = []
    for _ in range(2):  # a second run only when the first had to fill Numba's cache
        proc = subprocess.run([sys.executable, "-m", "moebalance", "plan", str(path), "--devices",
                               "4", "--slots", "5", "--out", str(tmp_path / "p.npz"), "--force"],
                              capture_output=True, text=True, timeout=600, env=env)
        assert proc.returncode == 0, proc.stderr[-2000:]
        lines.append(proc.stdout.splitlines()[0])
        if "includes compilation" not in lines[-1]:
            break
    assert "the first call took" in lines[-1]
    assert "loading the planner's compiled kernels from Numba's on-disk cache" in lines[-1]
    assert "includes compilation" not in lines[-1]


def test_first_call_note_tells_compiling_from_loading():
    assert "compiling the planner's Numba kernels" in cli._first_call_note(12.0, 0, 40)
    assert "from Numba's on-disk cache" in cli._first_call_note(0.7, 15, 0)


def test_plan_saves_the_topology_and_inspect_uses_it(loads_file, tmp_path, capsys):
    path, w = loads_file
    topo = {"speed": [1.0, 0.5, 1.0], "slots": [6, 6, 6], "node": [0, 0, 1]}
    (tmp_path / "topo.json").write_text(json.dumps(topo))
    out = tmp_path / "p.npz"
    assert run_cli(["plan", str(path), "--topology", str(tmp_path / "topo.json"), "--out",
                    str(out)], capsys)[0] == 0
    placement, saved = Placement.load_with_topology(out)
    assert saved == Topology.from_dict(topo)
    rc, stdout, err = run_cli(["inspect", str(out), "--loads", str(path)], capsys)
    assert rc == 0, err
    assert "topology (saved with the placement)" in stdout and "equally fast" not in stdout
    assert f"imbalance {summary_imbalance(w, placement, saved):.4f}" in stdout


def test_inspect_layout_prints_each_devices_experts_and_shares(loads_file, tmp_path, capsys):
    path, w = loads_file
    out = tmp_path / "p.npz"
    assert run_cli(["plan", str(path), "--devices", "4", "--slots", "5", "--out", str(out)],
                   capsys)[0] == 0
    p = Placement.load(out)
    rc, stdout, err = run_cli(["inspect", str(out), "--layout"], capsys)
    assert rc == 0, err
    assert [line for line in stdout.splitlines() if line.startswith("layer ")] == [
        f"layer {layer}: experts of each device, with each replica's share of its expert's tokens"
        for layer in range(3)]
    rc, stdout, err = run_cli(["inspect", str(out), "--layer", "2", "--loads", str(path)], capsys)
    assert rc == 0, err
    table = stdout[stdout.index("layer 2:"):].splitlines()[1:]
    assert table[0].split()[:4] == ["device", "speed", "node", "load/speed"]
    times = p.device_loads(w)[2] / (w[2].sum() / 4)
    for g, line in enumerate(table[2:]):
        slots = np.flatnonzero(p.slot_device == g)
        expected = "  ".join(f"{p.phy2log[2, s]} ({p.share[2, s]:.2f})" for s in slots)
        assert line.split()[0] == str(g) and line.endswith(expected)
        assert f"{times[g]:.3f}" in line
    assert "layer 0:" not in stdout
    rc, _, err = run_cli(["inspect", str(out), "--layer", "3"], capsys)
    assert rc == 2 and "--layer 3" in err and "3 layers" in err


def test_plan_reads_npz_pt_and_a_topology_file(tmp_path, capsys):
    torch = pytest.importorskip("torch")
    w = np.random.default_rng(2).uniform(1, 100, size=(2, 6))
    np.savez(tmp_path / "many.npz", steps=np.zeros(3), counts=w)
    torch.save({"loads": torch.tensor(w)}, tmp_path / "loads.pt")
    topo = {"speed": [1.0, 0.5, 1.0], "slots": [3, 3, 2], "node": [0, 0, 1]}
    (tmp_path / "topo.json").write_text(json.dumps(topo))
    for source in (["many.npz", "--key", "counts"], ["loads.pt"]):
        out = tmp_path / f"{source[0]}.placement.npz"
        rc, _, err = run_cli(["plan", str(tmp_path / source[0]), *source[1:], "--topology",
                              str(tmp_path / "topo.json"), "--out", str(out)], capsys)
        assert rc == 0, err
        Placement.load(out).validate(Topology.from_dict(topo))


def test_plan_plans_per_step_counts_for_the_steps_and_reports_them(tmp_path, capsys):
    steps = np.random.default_rng(3).integers(0, 50, size=(12, 2, 8)).astype(float)
    np.save(tmp_path / "steps.npy", steps)
    rc, stdout, err = run_cli(["plan", str(tmp_path / "steps.npy"), "--devices", "4", "--slots",
                               "3", "--out", str(tmp_path / "p.npz")], capsys)
    assert rc == 0, err
    assert "planned 2 layers x 8 experts" in stdout
    # the Rebalancer's call: planned for the window's steps, not for their mean
    topo = Topology.from_arrays(np.ones(4), [3] * 4)
    saved = Placement.load(tmp_path / "p.npz")
    expected = plan(steps, topo)
    assert np.array_equal(saved.phy2log, expected.phy2log)
    assert np.allclose(saved.share, expected.share)
    per_step = step_imbalance(steps, expected, topo).mean()
    assert "on the steps' mean load: imbalance" in stdout
    assert "per step (12 steps of the file, each re-split" in stdout
    assert f"imbalance {per_step:.4f}" in stdout
    # inspect judges the same file step by step
    rc, stdout, err = run_cli(["inspect", str(tmp_path / "p.npz"), "--loads",
                               str(tmp_path / "steps.npy")], capsys)
    assert rc == 0, err
    assert f"imbalance {per_step:.4f}" in stdout


def test_inspect_without_loads_or_topology_summarises_the_placement(loads_file, tmp_path, capsys):
    path, _ = loads_file
    out = tmp_path / "p.npz"
    rc, _, _ = run_cli(["plan", str(path), "--devices", "3", "--slots", "7", "--out", str(out)],
                       capsys)
    assert rc == 0
    rc, stdout, _ = run_cli(["inspect", str(out)], capsys)
    assert rc == 0 and "7: 3" in stdout and "replicas per expert" in stdout
    assert "imbalance" not in stdout


# -- bad input: one line, exit status 2, the argument named ---------------------------------------

@pytest.mark.parametrize("argv, named", [
    (["plan", "{loads}", "--devices", "0", "--slots", "5"], "--devices"),
    (["plan", "{loads}", "--devices", "four", "--slots", "5"], "--devices"),
    (["plan", "{loads}", "--devices", "4"], "--slots"),
    (["plan", "{loads}", "--slots", "4"], "--devices"),
    (["plan", "{loads}"], "--devices"),
    (["plan", "{loads}", "--devices", "4", "--slots", "5", "--cluster", "heterogeneous"],
     "--cluster"),
    (["plan", "{loads}", "--cluster", "no-such"], "--cluster"),
    (["plan", "{loads}", "--devices", "4", "--slots", "5", "--speed", "-1"], "--speed"),
    (["plan", "{loads}", "--devices", "4", "--slots", "5", "--max-moves", "-3"], "--max-moves"),
    (["plan", "{loads}", "--devices", "4", "--slots", "5", "--max-moves", "3"], "--previous FILE"),
    (["plan", "{loads}", "--devices", "2", "--slots", "5"], "slots"),
    (["plan", "{loads}", "--topology", "{missing}.json"], "--topology"),
    (["plan", "{missing}.npy", "--devices", "4", "--slots", "5"], "LOADS"),
    (["plan", "{dir}/loads.csv", "--devices", "4", "--slots", "5"], "LOADS"),
    (["plan", "{nan}", "--devices", "4", "--slots", "5"], "finite"),
    (["plan", "{loads}", "--devices", "4", "--slots", "5", "--previous", "{loads}"],
     "--previous: '{loads}' holds a numpy array (.npy), not a saved moebalance placement"),
    (["plan", "{text}", "--devices", "4", "--slots", "5"],
     "is named .npy but holds text; write it"),
    (["plan", "{npz_as_npy}", "--devices", "4", "--slots", "5"], "holds a zip archive"),
    (["plan", "{loads}", "--devices", "4", "--slots", "5", "--out", "{dir}/no-such/p.npz"],
     "--out: the folder"),
    (["plan", "{loads}", "--devices", "4", "--slots", "5", "--out", "{dir}"], "--out: "),
    (["inspect", "{text}"], "PLACEMENT: '{text}' holds text"),
    (["plan", "{loads}", "--devices", "5", "--slots", "5", "--previous", "{placement}"],
     "leave --previous out for a first placement"),
    (["inspect", "{missing}.npz"], "PLACEMENT"),
    (["inspect", "{loads}"], "PLACEMENT"),
    (["bench", "--repeats", "0"], "--repeats"),
    (["bench", "--workload", "imaginary"], "--workload"),
    (["frobnicate"], "frobnicate"),
    (["bench", "frobnicate"], "frobnicate"),
])
def test_bad_input_exits_2_with_one_line_naming_the_argument(argv, named, loads_file, tmp_path,
                                                             capsys):
    path, w = loads_file
    bad = w.copy()
    bad[1, 2] = np.nan
    np.save(tmp_path / "nan.npy", bad)
    (tmp_path / "text.npy").write_text("1,2,3\n4,5,6\n")
    assert cli.main(["plan", str(path), "--devices", "4", "--slots", "5", "--out",
                     str(tmp_path / "placement.npz")]) == 0
    capsys.readouterr()
    np.savez(tmp_path / "archive.npz", loads=w)
    (tmp_path / "archive.npz").rename(tmp_path / "archive.npy")
    names = {"loads": str(path), "missing": str(tmp_path / "missing"), "dir": str(tmp_path),
             "nan": str(tmp_path / "nan.npy"), "text": str(tmp_path / "text.npy"),
             "npz_as_npy": str(tmp_path / "archive.npy"),
             "placement": str(tmp_path / "placement.npz")}
    rc, _, err = run_cli([a.format(**names) for a in argv], capsys)
    assert rc == 2
    assert named.format(**names) in err and "Traceback" not in err
    for leak in ("allow_pickle", "context manager", "pass previous", "previous=", "max_moves"):
        assert leak not in err, leak
    assert len(err.strip().splitlines()) == 1, err


def test_bad_arguments_exit_2_from_the_real_command():
    proc = subprocess.run([sys.executable, "-m", "moebalance", "plan", "x.npy", "--devices", "-1"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "--devices" in proc.stderr and "Traceback" not in proc.stderr


def test_version_prints_the_package_version(capsys):
    import moebalance

    rc, out, _ = run_cli(["--version"], capsys)
    assert rc == 0 and moebalance.__version__ in out


# -- traps a new user falls into ------------------------------------------------------------------

def test_plan_keeps_an_existing_out_file_unless_forced(loads_file, tmp_path, capsys):
    path, _ = loads_file
    out = tmp_path / "p.npz"
    argv = ["plan", str(path), "--devices", "4", "--slots", "5", "--out", str(out)]
    assert run_cli(argv, capsys)[0] == 0
    before = out.read_bytes()
    rc, _, err = run_cli(argv, capsys)
    assert rc == 2 and "exists" in err and "--force" in err and out.read_bytes() == before
    rc, stdout, err = run_cli([*argv, "--force"], capsys)
    assert rc == 0 and f"wrote {out}" in stdout, err


def test_plan_with_previous_takes_the_topology_saved_with_it(loads_file, tmp_path, capsys):
    path, w = loads_file
    first, second = tmp_path / "a.npz", tmp_path / "b.npz"
    assert run_cli(["plan", str(path), "--devices", "4", "--slots", "5", "--devices-per-node",
                    "2", "--out", str(first)], capsys)[0] == 0
    rc, stdout, err = run_cli(["plan", str(path), "--previous", str(first), "--max-moves", "2",
                               "--out", str(second)], capsys)  # no topology flags
    assert rc == 0, err
    placement, saved = Placement.load_with_topology(second)
    assert saved == Topology.uniform(4, 5, 2) and placement.moves_from(Placement.load(first)) <= 2


def test_plan_cluster_names_the_other_namespace(loads_file, capsys):
    path, _ = loads_file
    rc, _, err = run_cli(["plan", str(path), "--cluster", "h100-64"], capsys)
    assert rc == 2 and "hardware preset of 'moebalance simulate'" in err
    assert "homogeneous-320" in err and len(err.strip().splitlines()) == 1


def test_bench_help_lists_every_sub_benchmark(capsys):
    rc, out, _ = run_cli(["--help"], capsys)
    assert rc == 0
    rc, bench_help, _ = run_cli(["bench", "--help"], capsys)
    for name in cli.SUB_BENCHMARKS:
        assert name in out and f"moebalance bench {name}" in " ".join(bench_help.split())
        assert f"moebalance bench {name}" in cli.__doc__


def test_tables_right_align_numbers_among_blank_cells_and_counts_agree():
    cells = [["a", "", "1.5"], ["bb", "12.25", ""]]
    text = report.format_text(("name", "GB/s", "TFLOP/s"), cells).splitlines()
    right_edge = text[0].index("GB/s") + len("GB/s")
    assert text[2].endswith("1.5") and text[3].index("12.25") + len("12.25") == right_edge
    assert report.format_markdown(("name", "GB/s", "TFLOP/s"), cells).splitlines()[1] == \
        "|---|---:|---:|"
    assert report.part_of(4.5, 80) == "4.5 of 80 (5.6%)" and report.part_of(4, 80) == \
        "4 of 80 (5.0%)"


def test_dispatch_table_keeps_flops_out_of_the_bandwidth_column():
    from moebalance.lab.bench import dispatch

    rows = [dispatch.Row("cpu", "permute", "numba", 1.0, 20.0, 1.5),
            dispatch.Row("experts", "4 slots", "grouped_mm", 2.0, None, 1.2, gflops=0.75)]
    cells = {c[0]: dict(zip(dispatch.COLUMNS, c)) for c in dispatch._cells(rows)}
    assert cells["cpu"]["GB/s"] == "20.00" and cells["cpu"]["GFLOP/s"] == ""
    assert cells["experts"]["GB/s"] == "" and cells["experts"]["GFLOP/s"] == "0.8"


def test_frontier_plot_tells_every_series_apart(tmp_path, monkeypatch):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from moebalance.lab.bench.migration import FrontierPoint, plot_frontier

    figures = []
    monkeypatch.setattr(plt, "close", figures.append)
    points = [FrontierPoint("synthetic", f"cluster-{c}", drift, budget, None, 1.0 + c / 10,
                            moves, moves, 0.0, 0.0)
              for c in range(7) for drift in (0.05, 0.2)
              for budget, moves in (("stale", 0.0), ("keep-old", 0.0), ("5%", 5.0),
                                    ("unlimited", 9.0), ("fresh", 90.0))]
    plot_frontier(points, tmp_path / "frontier.png")
    ax = figures[0].axes[0]
    series = {(matplotlib.colors.to_hex(line.get_color()), line.get_linestyle())
              for line in ax.get_lines()}
    assert len(ax.get_lines()) == 14 and len(series) == 14
    assert "0-10%" not in ax.get_title()


def test_plan_reads_a_text_table_of_loads(loads_file, tmp_path, capsys):
    path, w = loads_file
    csv = tmp_path / "loads.csv"
    names = ",".join(f"expert{e}" for e in range(w.shape[1]))
    np.savetxt(csv, w, delimiter=",", header=names, comments="")
    rc, stdout, err = run_cli(["plan", str(csv), "--devices", "4", "--slots", "5", "--out",
                               str(tmp_path / "p.npz")], capsys)
    assert rc == 0, err
    topo = Topology.uniform(4, 5)
    p = Placement.load(tmp_path / "p.npz").validate(topo)
    assert f"imbalance {summary_imbalance(w, p, topo):.4f}" in stdout
    ragged = tmp_path / "ragged.txt"
    ragged.write_text("1 2 3\n4 5\n")
    rc, _, err = run_cli(["plan", str(ragged), "--devices", "2", "--slots", "2", "--out",
                          str(tmp_path / "q.npz")], capsys)
    assert rc == 2 and "LOADS: " in err and "one row of loads per layer" in err
    assert not (tmp_path / "q.npz").exists()
