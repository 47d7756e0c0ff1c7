"""Native step programs (codegen/cpu/program.py, program.cpp): a bound decode step runs as one
native call (the LM head and the sampling tail included where the head is native), and every step
gives bit for bit what the executor's own Python loop gives (the kernels' Python dispatch,
binding off), for decode and mixed prefill/decode steps, sampled rows and drafts included."""
import pytest
import torch

import deepfuse
from deepfuse.codegen.cpu.bound import StepBinder
from deepfuse.codegen.cpu.program import NativeGuard, NativeOp, NativeStop
from deepfuse.ir import DTYPES
from deepfuse.runtime.batch import SeqChunk, StepBuffers
from deepfuse.runtime.kv_cache import CacheConfig, KVCache

BUILDS = {"f32": ("f32", None, None), "bf16": ("bf16", None, None), "int4": ("bf16", "int4", None),
          "w8a8-kv8": ("bf16", "w8a8", "int8"), "int4-a8": ("bf16", "int4-a8", None)}


def head_binds(native, kind: str) -> bool:
    """Whether the build's LM head (and so the sampling tail) binds: a native GEMM's head (W8A8,
    f32 panels, bf16 panels where this CPU has AMX or AVX512-BF16), not oneDNN's."""
    return kind in ("f32", "w8a8-kv8", "int4-a8") or native.bf16_gemm_available()


def compiled(tiny_model, native, kind: str):
    if kind in ("w8a8-kv8", "int4-a8") and not (native.i8_gemm_available() and native.q4a8_gemm_available()):
        pytest.skip("this CPU has no AVX512-VNNI")
    dtype, quant, kv = BUILDS[kind]
    return deepfuse.compile(tiny_model, dtype=dtype, quant=quant, kv_cache_dtype=kv)


def run_step(art, buffers, cache, chunks, bound: bool, edit=None, copy: bool = True) -> list[torch.Tensor]:
    """The step's outputs (copied unless told), through the native program (bound) or the
    executor's loop. edit(inputs): changes the filled inputs before the step runs."""
    runner = art.runner
    kept = runner.binder
    runner.binder = kept if bound else None
    try:
        inputs = buffers.fill(chunks, cache)
        if edit is not None:
            edit(inputs)
        return [t.clone() if copy else t for t in art(inputs) if isinstance(t, torch.Tensor)]
    finally:
        runner.binder = kept


def kv_cache(art) -> KVCache:
    """A cache of the build's KV layout (as the engine makes it)."""
    c, kv = art.config, art.kv_cache_type
    return KVCache(c.num_layers, c.num_kv_heads, kv.shape[4], DTYPES[kv.dtype], CacheConfig(block_size=4, num_blocks=32))


@pytest.mark.parametrize("kind", list(BUILDS))
def test_decode_steps_run_as_one_native_call_and_equal_the_executor_loop(tiny_model, native, kind):
    art = compiled(tiny_model, native, kind)
    art.runner.binder = StepBinder()
    cache = kv_cache(art)
    buffers = StepBuffers(16, 4, 8)
    blocks = [[0, 1, 2], [3, 4, 5], [6, 7, 8]]
    prompts = [[5, 9, 17], [44, 2, 8], [7, 7, 1]]
    run_step(art, buffers, cache, [SeqChunk(p, 0, b) for p, b in zip(prompts, blocks)], bound=False)
    for step in range(5):
        tokens = [(3 * step + i) % 100 + 1 for i in range(3)]
        chunks = [SeqChunk([t], 3 + step, b) for t, b in zip(tokens, blocks)]
        got = run_step(art, buffers, cache, chunks, bound=True)
        want = run_step(art, buffers, cache, chunks, bound=False)  # rewrites the same cache rows
        assert all(torch.equal(a, b) for a, b in zip(got, want))
    (prefix,) = art.runner.binder.cache.values()
    if head_binds(native, kind):  # the head, the sampler, spec_verify and the sampled rows too
        assert prefix.count == len(art.runner.launches)
    else:
        assert prefix.count >= len(art.runner.launches) - 5  # all but the sampling tail
    assert all(isinstance(c, (NativeOp, NativeStop)) for c in prefix.calls)
    assert (prefix.segments.programs, prefix.segments.python_calls) == (1, 0)  # one native call


@pytest.mark.parametrize("sampler", ["native", "refused"])
@pytest.mark.parametrize("kind", list(BUILDS))
def test_a_bound_tail_gives_fresh_outputs_with_sampled_rows_and_drafts(tiny_model, native, kind, sampler,
                                                                       monkeypatch):
    """Steps of one decode layout through the bound tail: outputs are new tensors each step (a
    caller keeps them), and rows with a temperature or a draft give the loop's tokens. The native
    sampler draws and verifies them inside the program; where the self-check refused it
    ("refused"), such a row holds the program before the sampler or spec_verify (its stops), and
    the rest runs from Python."""
    if not head_binds(native, kind):
        pytest.skip("this CPU runs bf16 heads on oneDNN, whose GEMM allocates: the tail runs from Python")
    if sampler == "refused":
        monkeypatch.setattr(native, "sample_available", lambda: False)
    art = compiled(tiny_model, native, kind)
    art.runner.binder = StepBinder()
    cache = kv_cache(art)
    buffers = StepBuffers(16, 4, 8)
    blocks = [[0, 1, 2], [3, 4, 5], [6, 7, 8]]
    run_step(art, buffers, cache, [SeqChunk([5, 9, 17], 0, b) for b in blocks], bound=False)
    sampled = dict(temperature=0.8, top_k=5, top_p=0.9, seed=11)
    held = []  # each step's outputs as returned, and copies made then
    for step, (hot, draft) in enumerate([(None, None), (1, None), (None, 0), (0, 2), (None, None)]):
        chunks = [SeqChunk([(7 * step + i) % 50 + 1], 3 + step, b, **(sampled if i == hot else {}))
                  for i, b in enumerate(blocks)]

        def edit(inputs, row=draft):
            if row is not None:  # a draft on a decode row: spec_verify keeps what follows only if it equals the token
                inputs["draft_tokens"][row] = 3

        got = run_step(art, buffers, cache, chunks, bound=True, edit=edit, copy=False)
        held.append((got, [t.clone() for t in got]))
        want = run_step(art, buffers, cache, chunks, bound=False, edit=edit)
        assert all(torch.equal(a, b) for a, b in zip(got, want)), step
    for got, copies in held:  # later steps wrote none of an earlier step's outputs
        assert all(torch.equal(a, b) for a, b in zip(got, copies))
    (prefix,) = art.runner.binder.cache.values()
    assert prefix.count == len(art.runner.launches)
    assert [len(s) for s in prefix.segments.stops] == ([0] if sampler == "native" else [2])


@pytest.mark.parametrize("kind", list(BUILDS))
def test_mixed_prefill_and_decode_steps_equal_the_executor_loop(tiny_model, native, kind):
    art = compiled(tiny_model, native, kind)
    art.runner.binder = StepBinder()
    cache = kv_cache(art)
    buffers = StepBuffers(16, 4, 8)
    blocks = [[0, 1, 2], [3, 4, 5], [6, 7, 8]]
    run_step(art, buffers, cache, [SeqChunk([5, 9, 17, 4], 0, blocks[0])], bound=False)
    for new in ([3, 1, 4, 1, 5], [9, 2, 6], [5, 3, 5, 8, 9, 7]):  # one decode row and two prompt chunks
        chunks = [SeqChunk([11], 4, blocks[0]), SeqChunk(new, 0, blocks[1]), SeqChunk(new[:2], 0, blocks[2])]
        got = run_step(art, buffers, cache, chunks, bound=True)
        want = run_step(art, buffers, cache, chunks, bound=False)
        assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert any(p.count for p in art.runner.binder.cache.values())  # the launches before attention ran bound


def test_a_failed_guard_runs_nothing(native):
    prog = native.StepProgram()
    pos, out = torch.tensor([3, 9], dtype=torch.long), torch.zeros(2, 4)
    prog.guard_below(pos, 10)
    prog.add(torch.ones(2, 4), torch.ones(2, 4), out)
    assert prog.run() and torch.equal(out, torch.full((2, 4), 2.0))
    out.zero_()
    pos[1] = 10
    assert not prog.run() and not out.any()
    assert not NativeGuard(pos, 10)() and NativeGuard(pos, 11)()


def test_guards_go_before_every_part_when_the_first_call_is_python(native):
    """Segments whose first bound call is a Python call: the guard program goes first, and every
    part still runs, in order (or none, when the guard fails)."""
    from deepfuse.codegen.cpu.program import Segments, aten_op

    ran, pos = [], torch.tensor([1, 2])
    a, out = torch.ones(3), torch.zeros(3)
    calls = [lambda: ran.append("first"), aten_op("add", a, a, out), lambda: ran.append(float(out[0]))]
    segments = Segments(calls, [NativeGuard(pos, 5)])
    assert segments.run() == (None, {}) and ran == ["first", 2.0]
    pos[0], out[0] = 5, 0.0
    assert segments.run()[0] == -1 and ran == ["first", 2.0] and out[0] == 0.0


def test_a_stop_holds_the_run_and_outputs_are_new_each_run(native):
    prog = native.StepProgram()
    x, temperature, drafts = torch.tensor([[0.5, 3.0, -1.0], [2.0, 1.0, 2.0]]), torch.zeros(2), torch.full((2,), -1)
    logits, tokens = prog.output([2, 3], torch.float32), prog.output([2], torch.int64)
    prog.index_select_to(x, torch.tensor([0, 1]), logits)
    prog.stop_unless_at_most(temperature, 0.0)
    prog.argmax_to(logits, tokens)
    prog.stop_unless_below(drafts, 0)
    status, (first, picked) = prog.run_step()
    assert status == 2 and torch.equal(first, x) and picked.tolist() == [1, 0]
    status, (second, _) = prog.run_step()
    assert second.data_ptr() != first.data_ptr() and torch.equal(second, x)
    temperature[1] = 0.5
    assert prog.run_step()[0] == 0 and not prog.run()  # held before the argmax
    temperature[1] = float("nan")  # not above 0: as the kernel's check has it
    drafts[0] = 4
    assert prog.run_step()[0] == 1
    with pytest.raises(RuntimeError, match="no output slot"):
        prog.argmax_to(logits, 5)


def test_the_spec_verify_kernel_equals_its_reference():
    from deepfuse.codegen.cpu.kernels import make_kernel
    from deepfuse.ir import OPS

    kernel, ref = make_kernel("spec_verify", {}), OPS["spec_verify"].reference
    g = torch.Generator().manual_seed(0)
    for r in range(0, 12):
        tokens = torch.randint(0, 3, (r,), generator=g)
        for drafts in (torch.full((r,), -1), torch.where(torch.rand(r, generator=g) < 0.3, -1,
                                                         torch.randint(0, 3, (r,), generator=g))):
            assert torch.equal(kernel(tokens, drafts), ref(tokens, drafts))


def test_the_native_layout_key_tells_layouts_apart_as_the_python_key_does(native):
    """bound.layout_key's native form against its Python form on the same lists of tensors: two
    lists get equal keys exactly when their Python keys are equal."""
    base, other = torch.zeros(4, 6), torch.zeros(4, 6)
    variants = [base, other, base[1:], base.t(), base.view(24), base.view(2, 12), base.view(torch.int32),
                base[:, :3], base[:, ::2], torch.zeros(()), base.clone()]
    lists = [[a, b] for a in variants for b in variants[:4]]

    def python_key(ts):
        return tuple((t.data_ptr(), t.dtype, *t.shape, *t.stride()) for t in ts)

    keys = [(native.layout_key(ts), python_key(ts)) for ts in lists]
    for nk, pk in keys:
        for nk2, pk2 in keys:
            assert (nk == nk2) == (pk == pk2)


def test_an_op_that_raises_mid_run_leaves_the_program_runnable(native):
    """An out-of-range row id raises from inside the run (a clear error, not a crash), and the next
    run with good ids gives fresh, right outputs."""
    prog = native.StepProgram()
    x, ids = torch.arange(6.0).view(3, 2), torch.tensor([2, 0])
    rows = prog.output([2, 2], torch.float32)
    prog.index_select_to(x, ids, rows)
    ids[0] = 7
    with pytest.raises((RuntimeError, IndexError), match="out of range|index"):
        prog.run_step()
    ids[0] = 2
    status, (got,) = prog.run_step()
    assert status == 0 and torch.equal(got, x[[2, 0]])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.int64])
def test_a_programs_row_gathers_copy_the_rows_index_select_picks(native, dtype):
    """index_select and index_select_to in a program (a native row copy for a contiguous table
    and out and int64 ids; ATen's otherwise) give torch.index_select's rows: repeated ids, a table
    of more than two dims, a strided table, a strided out."""
    torch.manual_seed(0)
    table = (torch.randn(50, 3, 4) * 100).to(dtype)
    ids = torch.tensor([7, 0, 49, 7, 12])
    strided = table[::2]  # not contiguous: ATen's index_select
    prog = native.StepProgram()
    into, into_strided = torch.empty(5, 3, 4, dtype=dtype), torch.empty(5, 3, 4, dtype=dtype)
    strided_out = torch.zeros(5, 3, 8, dtype=dtype)[..., ::2]  # ATen's too
    prog.index_select(table, ids, into)
    prog.index_select(strided, ids % 25, into_strided)
    prog.index_select(table, ids, strided_out)
    slot = prog.output([5, 3, 4], dtype)
    prog.index_select_to(table, ids, slot)
    status, (got,) = prog.run_step()
    assert status == 0
    assert torch.equal(into, torch.index_select(table, 0, ids)) and torch.equal(got, into)
    assert torch.equal(into_strided, torch.index_select(strided, 0, ids % 25))
    assert torch.equal(strided_out, into)


def test_a_prompts_row_gather_split_over_the_threads_copies_every_row(native):
    """A prompt's embedding rows (701 rows of 576 bf16, over 64 KB: uneven chunks on every
    thread) into tensors and a slot, three native ops (so the program runs them on its thread
    team): each row is table[id], none skipped or doubled at a chunk's edge."""
    g = torch.Generator().manual_seed(3)
    table = torch.randn(4096, 576, generator=g).bfloat16()
    ids = torch.randint(0, 4096, (701,), generator=g)
    prog = native.StepProgram()
    into, again = torch.zeros(701, 576, dtype=torch.bfloat16), torch.zeros(701, 576, dtype=torch.bfloat16)
    prog.index_select(table, ids, into)
    prog.index_select_to(table, ids, prog.output([701, 576], torch.bfloat16))
    prog.index_select(table, ids, again)
    status, (got,) = prog.run_step()
    assert status == 0
    want = torch.index_select(table, 0, ids)
    assert torch.equal(into, want) and torch.equal(got, want) and torch.equal(again, want)


@pytest.mark.parametrize("bad", [50, -1])
def test_a_row_gather_refuses_an_id_outside_the_table_before_copying_any(native, bad):
    table, out = torch.arange(100.0).view(50, 2), torch.full((3, 2), -5.0)
    prog = native.StepProgram()
    prog.index_select(table, torch.tensor([1, 2, bad]), out)
    with pytest.raises(RuntimeError, match=f"index {bad} is out of range for 50 rows"):
        prog.run()
    assert torch.equal(out, torch.full((3, 2), -5.0))  # the good rows before it were not copied either
    prog = native.StepProgram()  # into a slot: the same native copy
    prog.index_select_to(table, torch.tensor([0, bad]), prog.output([2, 2], torch.float32))
    with pytest.raises(RuntimeError, match=f"index {bad} is out of range for 50 rows"):
        prog.run_step()


def test_a_row_gather_into_its_own_table_is_refused(native):
    table = torch.arange(20.0).view(10, 2)
    prog = native.StepProgram()
    prog.index_select(table, torch.tensor([5, 6]), table[:2])
    with pytest.raises(RuntimeError, match="out overlaps the table"):
        prog.run()
    assert torch.equal(table, torch.arange(20.0).view(10, 2))


def test_a_profiled_program_times_each_op_in_order(native):
    """profile(True): each op's nanoseconds over the runs since (the big add, ~2,000x the work of
    the small index_select, takes longer, whichever order they stand in); Segments names them in
    order and averages over the runs; profile(False) clears; runs before profile(True) are not
    counted."""
    from deepfuse.codegen.cpu.program import Segments, aten_op

    big, small = torch.ones(4_000_000), torch.arange(2_000.0)
    big_out, small_out, ids = torch.empty_like(big), torch.empty(2), torch.tensor([5, 7])
    add, select = aten_op("add", big, big, big_out), aten_op("index_select", small, ids, small_out)
    for calls, names in (([select, add], ["index_select", "add"]), ([add, select], ["add", "index_select"])):
        segments = Segments(calls, [])
        segments.run()  # not profiled
        segments.profile(True)
        for _ in range(10):
            assert segments.run() == (None, {})
        runs, timed = segments.op_seconds()
        assert runs == 10 and [name for name, _ in timed] == names
        seconds = dict(timed)
        assert seconds["add"] > 5 * seconds["index_select"] > 0
        segments.profile(False)
        assert segments.parts[0].op_ns() == ([], 0) and segments.op_seconds() == (0, [])


def test_a_run_a_stop_holds_counts_with_nothing_for_the_ops_after_it(native):
    prog = native.StepProgram()
    a, out, limit = torch.ones(1000), torch.empty(1000), torch.tensor([0])
    prog.add(a, a, out)
    prog.stop_unless_below(limit, 1)
    prog.profile(True)
    prog.add(a, a, out)  # added while profiling
    assert prog.run_step()[0] == 1  # every op ran
    (first, second), runs = prog.op_ns()
    assert runs == 1 and first > 0 and second > 0
    limit[0] = 5
    assert prog.run_step()[0] == 0  # held before the second add
    ns, runs = prog.op_ns()
    assert runs == 2 and ns[0] > first and ns[1] == second


def expected_chunks(n: int, grain: int, threads: int) -> list[int]:
    """at::parallel_for's split (its OpenMP backend): items 0..n-1 -> the thread that runs each."""
    if n <= grain or n == 1 or threads == 1:
        return [0] * n
    parts = min(threads, -(-n // grain)) if grain > 0 else threads
    step = -(-n // parts)
    return [i // step for i in range(n)]


@pytest.mark.parametrize("n,grain", [(8, 1), (5, 1), (9, 4), (3, 8), (1, 1), (64, 16)])
def test_a_programs_native_ops_fork_to_its_team_as_at_parallel_for_splits(native, n, grain):
    """Inside a program a run of three or more native ops shares the program's thread team: every
    item on the thread at::parallel_for gives it outside a program (the same split), the other
    threads doing their share. A shorter run (here one op after an ATen op) forks as outside."""
    threads = torch.get_num_threads()
    if threads < 2:
        pytest.skip("one thread: no team to fork to")
    want = expected_chunks(n, grain, threads)
    eager, eager_teamed = torch.full((n,), -1), torch.full((1,), -1)
    native.thread_map(grain, eager, teamed=eager_teamed)
    prog = native.StepProgram()
    maps = [torch.full((n,), -1) for _ in range(4)]
    copied, teamed = torch.empty(n, dtype=torch.int64), torch.full((4,), -1)
    for k in range(3):  # a run of three: one team
        prog.thread_map(grain, maps[k], teamed=teamed[k:k + 1])
    prog.add(maps[0], torch.zeros(n, dtype=torch.int64), copied)  # ATen: outside any team
    prog.thread_map(grain, maps[3], teamed=teamed[3:])  # a run of one: no team
    assert prog.run()
    assert all(m.tolist() == want for m in maps) and eager.tolist() == copied.tolist() == want
    assert (max(want) > 0) == (n > grain and n > 1)
    assert eager_teamed.tolist() == [0] and teamed.tolist() == [1, 1, 1, 0]


@pytest.mark.parametrize("fail_at", [0, 7])
def test_an_error_in_a_team_thread_raises_from_the_run_and_leaves_no_team_behind(native, fail_at):
    """A chunk that raises on the team's thread 0 (item 0) or on its last thread (item 7): the run
    raises that error once every thread has left the op, the ops after it do not run, and the
    same program (it raises again) and a new one run as before."""
    if torch.get_num_threads() < 2:
        pytest.skip("one thread: no team")
    where, after, teamed = torch.full((8,), -1), torch.full((8,), -1), torch.full((1,), -1)
    assert (expected_chunks(8, 1, torch.get_num_threads())[fail_at] == 0) == (fail_at == 0)
    prog = native.StepProgram()
    prog.thread_map(1, where, teamed=teamed)
    prog.thread_map(1, where, fail_at)
    prog.thread_map(1, after)
    for _ in range(2):
        with pytest.raises(RuntimeError, match=f"item {fail_at} fails, as asked"):
            prog.run()
        assert teamed.tolist() == [1] and after.tolist() == [-1] * 8  # on a team; the op after the failed one never ran
    ok = native.StepProgram()
    for _ in range(3):
        ok.thread_map(1, after, teamed=teamed)
    teamed[0] = -1
    assert ok.run() and teamed.tolist() == [1] and after.tolist() == expected_chunks(8, 1, torch.get_num_threads())


def test_one_thread_runs_a_program_without_a_team(native):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        where, teamed = torch.full((8,), -1), torch.full((1,), -1)
        prog = native.StepProgram()
        for _ in range(3):
            prog.thread_map(1, where, teamed=teamed)
        assert prog.run() and where.tolist() == [0] * 8 and teamed.tolist() == [0]
    finally:
        torch.set_num_threads(threads)
