"""AscendC for Ascend 950 (arch 3510): emitters (emit.py) and a strict CPU emulator of the
AscendC API subset they use (emu/kernel_operator.h, run by emulate.py with g++). Started:
rms_norm, add_rms_norm and swiglu; not yet a compile target (see docs/targets.md)."""
