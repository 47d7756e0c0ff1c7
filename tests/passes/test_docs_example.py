"""docs/writing-a-pass.md: every python block runs, in order, in one namespace."""
import os
import re

DOC = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "writing-a-pass.md")


def test_writing_a_pass_example_runs():
    text = open(DOC).read()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert len(blocks) == 5
    # the op, its decomposition, the rule, the pass, and compiling it for four targets
    user_lines = [ln for b in blocks[:2] + blocks[4:] for ln in b.splitlines() if ln.strip()]
    assert len(user_lines) <= 30, len(user_lines)
    namespace: dict = {}
    for block in blocks:
        exec(compile(block, DOC, "exec"), namespace)
    assert namespace["fuse_silu_mul"].fn.fired == {"silu_mul": 1}
