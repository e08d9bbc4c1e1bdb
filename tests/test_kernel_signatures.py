"""Every kernel launch in moebalance/dispatch/cuda.py passes the arguments its kernel in csrc/
takes: their number and their kinds (pointer or int64), read from the CUDA source and from the
launch sites' syntax tree. Neither CuPy nor the driver checks a launch, so a missing argument
would only show on a GPU, as a crash; here it fails on any machine."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from moebalance.dispatch import cuda
from moebalance.dispatch.kernel_signatures import Param, kernel_signatures

ROOT = Path(__file__).resolve().parents[1]
LAUNCHER = ROOT / "moebalance" / "dispatch" / "cuda.py"
SOURCES = sorted((ROOT / "csrc").glob("*.cu"))

# Calls whose result is a tensor (a pointer argument) or an int (a scalar one).
_TENSOR_METHODS = {"contiguous", "to", "view", "reshape", "detach", "sum", "clone", "zero_"}
_INT_CALLS = {"numel", "len", "int", "max", "min", "element_size"}


def _all_signatures(sources: dict[str, str]) -> dict[str, tuple[Param, ...]]:
    table = {}
    for name, text in sources.items():
        for kernel, params in kernel_signatures(text).items():
            assert kernel not in table, f"kernel {kernel} is defined in two files ({name})"
            table[kernel] = params
    return table


def _kind(node: ast.expr, env: dict[str, str]) -> str:
    """"ptr" or "i64" for one launch argument; raises when the syntax cannot tell."""
    if isinstance(node, ast.Constant):
        if node.value is None:
            return "ptr"
        if isinstance(node.value, int) and not isinstance(node.value, bool):
            return "i64"
    if isinstance(node, ast.Name) and node.id in env:
        return env[node.id]
    if isinstance(node, ast.IfExp):
        kinds = {_kind(n, env) for n in (node.body, node.orelse)}
        if len(kinds) == 1:
            return kinds.pop()
    if isinstance(node, ast.Subscript) and (
            (isinstance(node.value, ast.Attribute) and node.value.attr == "shape")
            or (isinstance(node.value, ast.Name) and env.get(node.value.id) == "ints")):
        return "i64"
    if isinstance(node, (ast.BinOp, ast.UnaryOp)):
        operands = [node.left, node.right] if isinstance(node, ast.BinOp) else [node.operand]
        kinds = {_kind(n, env) for n in operands}
        return "ptr" if "ptr" in kinds else "i64"
    if isinstance(node, ast.Call):
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
        if name in _INT_CALLS or env.get(f"{name}()") == "i64":
            return "i64"
        if name == "next" and isinstance(node.args[0], ast.GeneratorExp) and all(
                isinstance(e, ast.Constant) and type(e.value) is int
                for e in getattr(node.args[0].generators[0].iter, "elts", [None])):
            return "i64"     # next(w for w in (16, 8, 4, 2) if ...)
        if name in _TENSOR_METHODS or (isinstance(func, ast.Attribute)
                                       and getattr(func.value, "id", "") == "torch"):
            return "ptr"
    raise AssertionError(f"line {node.lineno}: cannot tell whether {ast.unparse(node)!r} is a "
                         f"tensor or an int")


def _bind(target: ast.expr, value: ast.expr, env: dict[str, str]) -> None:
    if isinstance(target, ast.Name):
        try:
            env[target.id] = _kind(value, env)
        except AssertionError:
            env.pop(target.id, None)      # not a launch argument, or reported where it is used
    elif isinstance(target, ast.Tuple):
        if isinstance(value, ast.Tuple) and len(value.elts) == len(target.elts):
            for t, v in zip(target.elts, value.elts):
                _bind(t, v, env)
        elif isinstance(value, ast.Attribute) and value.attr == "shape":
            for t in target.elts:
                _bind(t, ast.Constant(0, lineno=value.lineno), env)
        elif isinstance(value, ast.Name) and env.get(value.id) == "ints":
            for t in target.elts:
                _bind(t, ast.Constant(0, lineno=value.lineno), env)


def _env(function: ast.FunctionDef, module_env: dict[str, str]) -> dict[str, str]:
    """Kinds of the function's parameters (annotations) and assigned names, in source order."""
    env = dict(module_env)
    args = function.args
    for arg in [*args.posonlyargs, *args.args, *args.kwonlyargs]:
        note = ast.unparse(arg.annotation) if arg.annotation is not None else ""
        if "Tensor" in note:
            env[arg.arg] = "ptr"
        elif note == "int":
            env[arg.arg] = "i64"
    for node in ast.walk(function):
        if isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Name) and isinstance(node.value, ast.Tuple) \
                        and all(_is_int(e, env) for e in node.value.elts):
                    env[target.id] = "ints"       # a tuple of ints, e.g. a shape
                else:
                    _bind(target, node.value, env)
    return env


def _is_int(node: ast.expr, env: dict[str, str]) -> bool:
    try:
        return _kind(node, env) == "i64"
    except AssertionError:
        return False


def _name_pattern(node: ast.expr) -> re.Pattern:
    """The kernel names a launch's name argument can take (f-string holes match any word)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return re.compile(re.escape(node.value))
    if isinstance(node, ast.JoinedStr):
        return re.compile("".join(re.escape(part.value) if isinstance(part, ast.Constant)
                                  else r"\w*" for part in node.values))
    raise AssertionError(f"line {node.lineno}: the kernel name {ast.unparse(node)!r} is neither a "
                         f"string nor an f-string")


def launch_problems(launcher_source: str, cuda_sources: dict[str, str]) -> list[str]:
    """Every mismatch between a ``_launch(device, name, grid, (args...))`` call of the launcher
    and the parameters of the kernels its name can take (an empty list when all agree)."""
    table = _all_signatures(cuda_sources)
    problems, launches = [], 0
    tree = ast.parse(launcher_source)
    module_env: dict[str, str] = {}     # module constants (_BLOCK, _MIN_SORT_CHUNK, ...)
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.returns is not None \
                and ast.unparse(node.returns) == "int":
            module_env[f"{node.name}()"] = "i64"        # a call of it is an int (_grid, ...)
        if isinstance(node, ast.Assign):
            for target in node.targets:
                _bind(target, node.value, module_env)
    for function in ast.walk(tree):
        if not isinstance(function, ast.FunctionDef):
            continue
        env = _env(function, module_env)
        for call in ast.walk(function):
            if not (isinstance(call, ast.Call) and getattr(call.func, "id", "") == "_launch"):
                continue
            launches += 1
            name_node, args_node = call.args[1], call.args[3]
            where = f"{function.name} (line {call.lineno})"
            if not isinstance(args_node, ast.Tuple):
                problems.append(f"{where}: the arguments are not a tuple literal")
                continue
            pattern = _name_pattern(name_node)
            kernels = [k for k in table if pattern.fullmatch(k)]
            if not kernels:
                problems.append(f"{where}: no kernel is named like {ast.unparse(name_node)}")
            try:
                kinds = [_kind(a, env) for a in args_node.elts]
            except AssertionError as exc:
                problems.append(f"{where}: {exc}")
                continue
            for kernel in kernels:
                params = table[kernel]
                if len(kinds) != len(params):
                    problems.append(f"{where}: {kernel} takes {len(params)} arguments "
                                    f"({', '.join(p.name for p in params)}), launched with "
                                    f"{len(kinds)}")
                    continue
                for i, (kind, param) in enumerate(zip(kinds, params)):
                    if kind != param.kind:
                        problems.append(f"{where}: argument {i} of {kernel} ({param.name}) is "
                                        f"a {param.kind}, the launch passes a {kind}")
    if launches == 0:
        problems.append("no _launch call found")
    return problems


def _sources() -> dict[str, str]:
    return {p.name: p.read_text() for p in SOURCES}


def test_every_launch_matches_its_kernels_signature():
    assert launch_problems(LAUNCHER.read_text(), _sources()) == []


def test_every_scalar_parameter_is_int64():
    # The launcher passes every Python int as int64: a narrower scalar would be misread.
    for kernel, params in _all_signatures(_sources()).items():
        for p in params:
            assert p.kind in ("ptr", "i64"), f"{kernel}: {p.name} is a {p.kind}"


def test_the_runtime_table_is_the_shipped_source():
    assert cuda.signatures() == kernel_signatures(cuda.source())
    assert set(cuda.KERNEL_NAMES) == set(cuda.signatures())


def _replace_once(text: str, old: str, new: str) -> str:
    assert text.count(old) == 1, old
    return text.replace(old, new)


def test_a_launch_missing_an_argument_is_reported():
    # The launch of combine_weight_grad_* without its `out` pointer: 7 arguments for 8.
    launcher = _replace_once(LAUNCHER.read_text(), "pos_TK.contiguous(), out, pairs,",
                             "pos_TK.contiguous(), pairs,")
    problems = launch_problems(launcher, _sources())
    assert len(problems) == 4 and all("takes 8 arguments" in p and "launched with 7" in p
                                      for p in problems), problems
    assert {p.split(": ")[1].split()[0] for p in problems} == {
        f"combine_weight_grad_{s}" for s in ("f32", "f64", "bf16", "f16")}


def test_a_kernel_gaining_a_parameter_is_reported():
    source = _replace_once(_sources()["dispatch.cu"],
                           "i64 chunk, i64 num_chunks, i64* __restrict__ hist_SC)",
                           "i64 chunk, i64 num_chunks, i64* __restrict__ hist_SC, i64 extra)")
    problems = launch_problems(LAUNCHER.read_text(), {"dispatch.cu": source})
    assert len(problems) == 1 and "slot_chunk_histogram takes 7" in problems[0], problems


def test_a_swapped_pointer_and_int_is_reported():
    launcher = _replace_once(LAUNCHER.read_text(), "(x, index, out, n, row_bytes // word,",
                             "(x, index, n, out, row_bytes // word,")
    problems = launch_problems(launcher, _sources())
    assert len(problems) == 8, problems      # 4 gather_rows_w* kernels x 2 swapped arguments
    assert any("argument 2 of gather_rows_w16 (out) is a ptr, the launch passes a i64" in p
               for p in problems)


def test_macro_expansion_and_comments_are_read_like_the_compiler():
    source = """
    // extern "C" __global__ void commented_out(int x) {}
    #define PAIR(T, S) \\
        extern "C" __global__ void add_##S(const T* a, T* b, i64 n) {} \\
        extern "C" __global__ void set_##S(T* b, i64 n) {}
    PAIR(float, f32)
    PAIR(double, f64)
    """
    table = kernel_signatures(source)
    assert sorted(table) == ["add_f32", "add_f64", "set_f32", "set_f64"]
    assert table["add_f64"] == (Param("a", "ptr"), Param("b", "ptr"), Param("n", "i64"))


@pytest.mark.parametrize("bad", ["extern \"C\" __global__ void k(int) {}",
                                 "#define M(a, b) a\nM(1)"])
def test_unreadable_sources_raise(bad):
    with pytest.raises(ValueError):
        kernel_signatures(bad)


def test_launch_asserts_the_argument_count_before_touching_a_gpu(monkeypatch):
    # _launch checks the table before importing CuPy or reading a device.
    with pytest.raises(AssertionError, match="takes 8 arguments .* launched with 7"):
        cuda._launch(None, "combine_weight_grad_f32", 1, (None,) * 3 + (1,) * 4)
    with pytest.raises(AssertionError, match="out is a ptr, got an int"):
        cuda._launch(None, "combine_f32", 1, (None, None, None, 5, 1, 1, 1, 1))


def test_resplit_kernel_signature_matches_its_launch():
    """csrc/resplit.cu declares its kernel inside an ``extern "C"`` block; the launch in
    resplit_cuda.py passes 7 arrays, 6 int64 scalars and 2 work arrays, in that order."""
    from dataclasses import fields

    from moebalance.dispatch import resplit_cuda
    from moebalance.dispatch.shares import ResplitPlan

    params = kernel_signatures(resplit_cuda.source())[resplit_cuda.KERNEL_NAME]
    assert [p.kind for p in params] == ["ptr"] * 7 + ["i64"] * 6 + ["ptr"] * 2
    tree = ast.parse((ROOT / "moebalance" / "dispatch" / "resplit_cuda.py").read_text())
    function = next(n for n in tree.body if isinstance(n, ast.FunctionDef)
                    and n.name == "resplit_shares_cuda")
    env = _env(function, {})
    tensors = {f.name for f in fields(ResplitPlan) if "Tensor" in str(f.type)}
    launches = [n for n in ast.walk(function) if isinstance(n, ast.Call)
                and ast.unparse(n.func) == "_SOURCE.launch"]
    assert len(launches) == 1
    name, args = launches[0].args[1], launches[0].args[4]
    assert ast.unparse(name) == "KERNEL_NAME" and isinstance(args, ast.Tuple)
    kinds = ["ptr" if isinstance(a, ast.Attribute) and ast.unparse(a.value) == "plan"
             and a.attr in tensors else _kind(a, env) for a in args.elts]
    assert kinds == [p.kind for p in params], list(zip(kinds, params))


def test_a_launch_is_checked_before_any_gpu_is_touched():
    from moebalance.dispatch import resplit_cuda

    source = resplit_cuda._SOURCE
    with pytest.raises(AssertionError, match="takes 15 arguments .* launched with 14"):
        source.launch(None, resplit_cuda.KERNEL_NAME, 1, 256, (None,) * 7 + (1,) * 6 + (None,))
    assert source.signatures() is source.signatures()       # parsed once
