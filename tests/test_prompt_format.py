"""The paper recipe's prompt, rendered as the model sees it, against LUFFY's format.

LUFFY's training prompt is ``[system: <its <think> system prompt>, user: <problem>]`` (luffy/scripts/data/
prepare_openr1_data_spec_sys.py:80 and 104-114; the same system message heads every row of its released
data/valid.parquet), passed through the model tokenizer's chat template with a generation prompt (luffy/verl/
verl/mix_src/rl_dataset_with_target.py:108). Our data command writes the messages
(scripts/data/prepare_openr1.py), the recipes keep the model's own template (no data.apply_chat_template_kwargs),
and the agent loop renders them the same way.

tests/fixtures/qwen2_5_math_chat_template.jinja is the ``chat_template`` of Qwen2.5-Math's tokenizer_config.json
(https://huggingface.co/Qwen/Qwen2.5-Math-7B/blob/main/tokenizer_config.json; Qwen2.5-Math-1.5B, the NGPUS=1
model, has the same), transcribed from a printout of ``AutoTokenizer.from_pretrained("Qwen/Qwen2.5-Math-1.5B")
.chat_template`` in a public notebook: not byte-compared with the Hub file here (no network)."""

import subprocess
from pathlib import Path

import pandas as pd
from transformers.utils.chat_template_utils import render_jinja_template

from scripts.data import prepare_openr1
from test_recipes import compose_recipe

REPO = Path(__file__).resolve().parents[1]
QWEN25_MATH_TEMPLATE = (Path(__file__).parent / "fixtures" / "qwen2_5_math_chat_template.jinja").read_text()

# LUFFY's system prompt, luffy/scripts/data/prepare_openr1_data_spec_sys.py:80 as Python reads it (its "\n" are
# newlines, its "\\boxed" one backslash); equal to the system message of LUFFY's data/valid.parquet (checked by hand).
LUFFY_SYSTEM_PROMPT = (
    "Your task is to follow a systematic, thorough reasoning process before providing the final solution. This "
    "involves analyzing, summarizing, exploring, reassessing, and refining your thought process through multiple "
    "iterations. Structure your response into two sections: Thought and Solution. In the Thought section, present "
    'your reasoning using the format: "<think>\n {thoughts} </think>\n". Each thought should include detailed '
    'analysis, brainstorming, verification, and refinement of ideas. After "</think>\n," in the Solution section, '
    "provide the final, logical, and accurate answer, clearly derived from the exploration in the Thought section. "
    "If applicable, include the answer in \\boxed{} for closed-form results like multiple choices or mathematical "
    "solutions."
)
PROBLEM = "Find $x$ such that $2x + 3 = 11$."


def _render(messages, **kwargs) -> str:
    rendered, _ = render_jinja_template([messages], chat_template=QWEN25_MATH_TEMPLATE, add_generation_prompt=True,
                                        **kwargs)  # fmt: skip
    return rendered[0]


def test_paper_recipe_prompt_is_luffys_format(capsys):
    """A fixture row through our data command, rendered with Qwen2.5-Math's template and the paper recipe's
    chat-template settings: byte for byte what LUFFY's dataset built."""
    row = pd.DataFrame([{"problem": PROBLEM, "answer": "4", "generations": ["<think>\n2x = 8</think> \\boxed{4}"]}])
    rows, _ = prepare_openr1.prepare(row, max_target_tokens=None, tokenizer=None,
                                     system_prompt=prepare_openr1.SYSTEM_PROMPT, data_source="openr1_math",
                                     split="train", where="fixture")  # fmt: skip
    messages = [dict(m) for m in rows[0]["prompt"]]
    assert messages == [{"role": "system", "content": LUFFY_SYSTEM_PROMPT}, {"role": "user", "content": PROBLEM}]
    cfg = compose_recipe("luffy_zero")
    kwargs = dict(cfg.data.get("apply_chat_template_kwargs") or {})
    luffy = f"<|im_start|>system\n{LUFFY_SYSTEM_PROMPT}<|im_end|>\n<|im_start|>user\n{PROBLEM}<|im_end|>\n<|im_start|>assistant\n"
    assert _render(messages, **kwargs) == luffy


def test_without_the_system_prompt_qwen_math_substitutes_its_own():
    """Why the system prompt must be in the data: the template's default system turn is Qwen's CoT prompt, with
    no <think> format (LUFFY issue #43: 1.5B runs without LUFFY's system prompt got zero reward)."""
    text = _render([{"role": "user", "content": PROBLEM}])
    assert text.startswith("<|im_start|>system\nPlease reason step by step, and put your final answer within \\boxed{}.")
    assert "<think>" not in text


def test_one_gpu_model_is_the_base_luffy_trained_at_1_5b():
    """NGPUS=1 trains Qwen2.5-Math-1.5B, the base of LUFFY's released LUFFY-Qwen-Math-1.5B-Zero (its README's
    model table), with the same template and the same data (so the same system prompt)."""
    out = subprocess.run(["bash", "-c", "source recipes/luffy_zero/../common.sh && echo $DEFAULT_MODEL_PATH_1GPU"],
                         cwd=REPO, capture_output=True, text=True, check=True)  # fmt: skip
    assert out.stdout.strip() == "Qwen/Qwen2.5-Math-1.5B"
    paper = (REPO / "mix_src" / "config" / "luffy_paper.yaml").read_text()  # every GPU recipe's base names both
    assert "system prompt = LUFFY's <think> system prompt" in paper and "chat template = the model's own" in paper
