"""``benchmarks.launch_sections`` on the CPU: a real engine's launches, timed by section inside
worker 0 and attributed to mixed and decode launches; sections nest (a launch holds its parts)."""

from benchmarks.launch_sections import run_mode


def test_sections_by_launch_kind(ray_local, ckpt_dir):
    ck = str(ckpt_dir("llama", max_pos=4096))
    kinds = run_mode("async", ck, "safetensors", num_prompts=12, prompt_len=40, max_num_seqs=4, vocab=200)
    mixed = kinds["mixed"]  # (on the CPU no decode graph exists: every launch is "mixed")
    assert mixed["launches"] > 10
    us, calls = mixed["us"], mixed["calls"]
    assert calls["launch"] == 1.0 and calls["build_step_inputs"] == 1.0
    assert 0 < us["build_window"] <= us["build_step_inputs"] <= us["launch"]
    assert calls["stage new requests (host)"] == 1.0  # (every launch: most stage none)
    # only some launches place prompts, in their input kernel's launch (its clears before it)
    assert 0 < calls["place new requests (in the input launch)"] < 1
    assert us["place new requests (in the input launch)"] <= us["build_window"]
