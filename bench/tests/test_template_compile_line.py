"""The templates' line on Wan Compile Blocks (bench/make_workflows.py): a template leaves the node out only where
the payback model says it would lengthen the first prompt of a first start, and its note gives the prompts by
which compiling pays back as the model (the Sage patch's panel) gives them."""
import re

import pytest

from bench import make_workflows
from wan_sage.memory import activation_model, compile_payback

# (preset, width, height, frames, rows, steps a model, experts) of each template the script builds
TEMPLATES = {
    "A14B 720p, 4 steps": ("wan2.2-a14b", 1280, 720, 81, 1, 2, 2),
    "A14B 480p, 4 steps": ("wan2.2-a14b", 832, 480, 81, 1, 2, 2),
    "TI2V-5B 704p121, 20 steps": ("wan2.2-ti2v-5b", 1280, 704, 121, 2, 20, 1),
    "I2V 14B 480p, 20 steps": ("wan2.1-i2v-14b", 832, 480, 81, 2, 20, 1),
}


def _prompts(line: str) -> tuple:
    def n(text):
        return 1 if text == "the first prompt" else int(text.split()[-1])
    m = re.search(r"pays back by (the first prompt|prompt \d+) of a first start and by (the first prompt|prompt \d+)"
                  r" after a restart", line)
    assert m, line
    return n(m.group(1)), n(m.group(2))


@pytest.mark.parametrize("name", TEMPLATES)
def test_a_template_line_gives_the_payback_prompts_of_the_model(name):
    preset, w, h, f, rows, steps, experts = TEMPLATES[name]
    line = make_workflows.compile_line(preset, w, h, f, rows=rows, steps=steps, experts=experts)
    dims = activation_model.PRESETS[preset]
    tokens = activation_model.tokens(dims, *activation_model.latent_shape(dims, w, h, f)[2:])
    fresh, kept = (compile_payback.compile_payback(dims, tokens, rows=rows, steps=steps, shared_by=experts, kept=k)
                   for k in (False, True))
    first_start, restart = _prompts(line)
    assert first_start > 1  # the node is left out only where it would lengthen the first prompt
    assert (first_start, restart) == (fresh.payback_prompt, kept.payback_prompt)
    # the prompt it names is the first whose steps have saved the compile: one prompt fewer has not
    saved = fresh.step_gain_s * steps * experts
    assert saved * first_start >= fresh.compile_s > saved * (first_start - 1)


def test_a_setup_whose_first_prompt_compiling_pays_back_is_refused():
    # A14B 720p81, 20 steps at cfg 5 (two rows): each compiled step saves about 1.6 s, 32 s over the prompt
    with pytest.raises(ValueError, match="should run Wan Compile Blocks"):
        make_workflows.compile_line("wan2.2-a14b", 1280, 720, 81, rows=2, steps=20)
