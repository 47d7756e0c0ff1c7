"""A hybrid model (sliding-window layers between full-attention ones, each group with its own
block table, slot mapping and seq_lens) on the device targets: sm90 in Triton's interpreter and
ascend950 in the AscendC emulator give the CPU target's tokens through the engine, with the
sliding group's blocks handed back and reused while the full group keeps its own."""
import pytest

import deepfuse
from deepfuse.models import Gemma3
from deepfuse.runtime.engine import Engine, SamplingParams
from deepfuse.runtime.kv_cache import CacheConfig
from tests.runtime.test_hybrid_cache import CONFIG, random_weights


@pytest.mark.parametrize("target", ["sm90", "ascend950"])
def test_hybrid_gemma_on_device_targets_gives_the_cpu_tokens(target):
    model = Gemma3(CONFIG, random_weights(Gemma3, CONFIG, seed=5))
    prompt = [(11 * i) % 90 + 3 for i in range(70)]  # 5 blocks of 16: the sliding group reuses its 3
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=2)
    run = lambda art: Engine(art, CacheConfig(block_size=16, num_blocks=8, sliding_blocks=3), max_num_tokens=16,
                             max_num_seqs=2).generate([prompt], [params])[0]
    want = run(deepfuse.compile(model))
    compiled = deepfuse.compile(model, target=target)
    assert compiled.plan["host_steps"] == []
    got = run(compiled)
    assert got.outputs[0].token_ids == want.outputs[0].token_ids
    for a, b in zip(got.outputs[0].logprobs, want.outputs[0].logprobs):
        assert a.keys() == b.keys() and max(abs(a[t].logprob - b[t].logprob) for t in a) < 1e-4
