"""An adapter read straight into a slot's dtype equals its float32 read rounded by NumPy's own cast (ml_dtypes),
bit for bit: whatever type it was saved in, whatever its scaling, for values from subnormal to near the
largest finite."""

import numpy as np
import jax.numpy as jnp
import pytest
from safetensors.numpy import load_file, save_file

from jlora import testing
from jlora.adapters.peft import as_dtype, read_adapter
from jlora.models.config import ModelConfig

CFG = testing.tiny_config("llama")


def _rewrite(path: str, dtype, rng) -> None:
    """The adapter's tensors saved in `dtype`, each at a random scale (its own exponent range) with a few
    values at its edges: subnormal, zero, negative zero."""
    file = f"{path}/adapter_model.safetensors"
    tensors = load_file(file)
    largest = {"float16": 1e3, "bfloat16": 1e30, "float32": 1e30}[np.dtype(dtype).name]
    smallest = {"float16": 1e-7, "bfloat16": 1e-40, "float32": 1e-44}[np.dtype(dtype).name]
    for key, t in tensors.items():
        t = t * np.float32(10.0 ** rng.uniform(np.log10(smallest), np.log10(largest)))
        flat = t.reshape(-1)
        flat[:3] = [smallest, 0.0, -0.0]
        tensors[key] = t.astype(dtype)
    save_file(tensors, file)


@pytest.mark.filterwarnings("ignore:overflow encountered in cast")  # alpha 65536 in a float16 slot: inf, as on the device
@pytest.mark.parametrize("saved", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("slot", ["bfloat16", "float16"])
def test_a_read_into_the_slot_dtype_equals_the_float32_read_rounded(tmp_path, saved, slot):
    config = ModelConfig.from_hf_config(CFG)
    rng = np.random.default_rng(hash((saved, slot)) % 2**32)
    slot = np.dtype(getattr(jnp, slot))
    for i, extra in enumerate([dict(alpha=8), dict(alpha=3, use_rslora=True), dict(alpha=65536, r=1),
                               dict(alpha=8, embeddings=True, lm_head=True)]):
        path = str(tmp_path / f"a{i}")
        extra = {"r": 4, **extra}
        testing.write_adapter(path, CFG, seed=i, target_modules=["q_proj", "v_proj", "down_proj"], **extra)
        _rewrite(path, getattr(jnp, saved), rng)
        wide = read_adapter(path, config, 8, 16)
        narrow = read_adapter(path, config, 8, 16, dtype=slot)
        pairs = [(w, n) for lw, ln in zip(wide.layers, narrow.layers) for g in lw for w, n in zip(lw[g], ln[g])]
        pairs += [(w, n) for part in ("embed", "lm_head") if getattr(wide, part) is not None
                  for w, n in zip(getattr(wide, part), getattr(narrow, part))]
        assert len(pairs) >= 8
        for w, n in pairs:
            assert w.dtype == np.float32 and n.dtype == slot
            np.testing.assert_array_equal(n.view(np.uint16), w.astype(slot).view(np.uint16))


def test_as_dtype_widens_bfloat16_exactly():
    bits = np.arange(1 << 16, dtype=np.uint16)  # every bfloat16, NaNs included
    x = bits.view(jnp.bfloat16)
    np.testing.assert_array_equal(as_dtype(x, np.float32), x.astype(np.float32))  # NaN == NaN here
    assert as_dtype(x, jnp.bfloat16) is x
