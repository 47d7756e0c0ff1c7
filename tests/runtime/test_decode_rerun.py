"""One-step decode on the CPU build reruns the last step's prepared calls (Engine.forward:
StepBuffers.refill, then CpuExecutor.rerun) where a decode step follows one of the same
sequences. The reference is the same artifact's executor running every launch from Python
(no bound calls, no native step programs, so nothing to rerun): the same outputs and the same
named KV, for requests that end at different steps for different reasons; a wrong refill is
caught; a fault inside a rerun step is undone."""
import dataclasses

import pytest

import deepfuse
from deepfuse.codegen.cpu.executor import CpuExecutor
from deepfuse.codegen.cpu.row_kernels import native_sampler
from deepfuse.runtime.batch import StepBuffers
from tests.runtime.test_decode_burst import engine
from tests.runtime.test_interrupted_step import FailingModel, Interrupt, no_leaks
from tests.runtime.test_overlap import PROMPTS, ending_params, outcome, same_prefix_cache


@pytest.fixture(scope="module")
def tiny_art(tiny_model):
    return deepfuse.compile(tiny_model)


@pytest.fixture(scope="module")
def python_art(tiny_model):
    """The same model, its executor running each launch from Python (CpuExecutor without a binder)."""
    art = deepfuse.compile(tiny_model)
    art.runner.binder = None
    return art


@pytest.fixture(scope="module")
def want(python_art, tiny_art):
    params = ending_params(tiny_art)
    eng = engine(python_art, 1)
    b = eng.buffers  # whole fills: the reference shares no incremental write with the code under test
    eng.buffers = StepBuffers(b.max_tokens, b.max_seqs, b.max_blocks, incremental=False)
    return params, [outcome(o) for o in eng.generate(PROMPTS, params)], eng


def test_one_step_decode_reruns_and_gives_the_python_loops_outputs(tiny_art, want, monkeypatch):
    params, outs, ref = want
    log, real = [], type(tiny_art).rerun
    monkeypatch.setattr(type(tiny_art), "rerun", lambda self, inputs: log.append(real(self, inputs)) or log[-1])
    eng = engine(tiny_art, 1)
    assert [outcome(o) for o in eng.generate(PROMPTS, params)] == outs
    assert {o[2] for o in outs} == {"length", "stop"} and len({len(o[1]) for o in outs}) >= 4
    # a step reruns where the one before it decoded the same sequences with the same block tables
    # (where the self-check refused the native sampler, a step with seeded rows stops before its
    # sampler and is not rerun)
    assert len(log) >= 3 and (all(out is not None for out in log) or native_sampler() is None)
    no_leaks(eng)
    same_prefix_cache(eng, ref)


def test_a_step_the_executor_does_not_rerun_is_a_new_call(tiny_art, want, monkeypatch):
    """Where rerun gives None (nothing ran), the step already written runs as a new model call
    over fresh views of it: the same outputs, one call a step."""
    params, outs, _ = want
    calls, real = [], CpuExecutor.__call__
    monkeypatch.setattr(CpuExecutor, "__call__", lambda self, inputs: calls.append(1) or real(self, inputs))
    monkeypatch.setattr(CpuExecutor, "rerun", lambda self, inputs: None)
    eng = engine(tiny_art, 1)
    assert [outcome(o) for o in eng.generate(PROMPTS, params)] == outs
    assert len(calls) == eng.stats.steps
    no_leaks(eng)


def test_a_wrong_refill_is_caught(tiny_art, want, monkeypatch):
    """The comparison has teeth: a refill that feeds each sequence the next token id changes the outputs."""
    params, outs, _ = want
    real = StepBuffers.refill
    monkeypatch.setattr(StepBuffers, "refill", lambda self, chunks, cache: real(
        self, [dataclasses.replace(c, tokens=[c.tokens[0] + 1]) for c in chunks], cache))
    assert [outcome(o) for o in engine(tiny_art, 1).generate(PROMPTS, params)] != outs


@pytest.mark.parametrize("after", [False, True], ids=["before the kernels", "after the kernels"])
def test_a_fault_in_a_rerun_step_is_undone(tiny_art, want, after):
    """A fault raised inside a rerun decode step (before its calls run, or once they have written
    its KV): stepping on gives the reference's tokens and leaks nothing."""
    params, outs, _ = want
    eng = engine(tiny_art, 1)
    reruns = []  # the third rerun fails
    eng.model = FailingModel(eng.model, lambda inputs: reruns.append(1) or len(reruns) == 3, after=after,
                             paths=("rerun",))
    ids = [eng.add_request(p, s) for p, s in zip(PROMPTS, params)]
    done, failures = {}, 0
    while eng.has_unfinished():
        try:
            done.update((o.request_id, outcome(o)) for o in eng.step())
        except Interrupt:
            failures += 1
    assert failures == 1 and eng.model.fired == "rerun"
    assert [done[i][1:] for i in ids] == [o[1:] for o in outs]
    no_leaks(eng)
