"""``pagedkv.models.chat_template`` renders exactly as transformers' ``apply_chat_template``
(tokenize=False) on templates that use the environment's features (namespace, loop controls,
``tojson``, tools, reasoning fields, ``{% generation %}``, model-specific special tokens,
several named templates, ``chat_template.jinja`` over ``tokenizer_config.json``), and refuses
bad input with ``ChatTemplateError``. The real-model (SmolLM2) comparison is in
test_real_model.py."""

import json
import os
import shutil

import pytest

from pagedkv.errors import ChatTemplateError
from pagedkv.models.chat_template import ChatTemplate, load_chat_template, render_chat

RICH_TEMPLATE = """\
{{ bos_token }}
{%- set ns = namespace(system='', n=0) %}
{%- for m in messages %}
  {%- if m['role'] == 'system' %}{% set ns.system = m['content'] %}{% continue %}{% endif %}
  {%- set ns.n = ns.n + 1 %}
{% endfor %}
{% if ns.system %}<<SYS>>{{ ns.system }}<</SYS>>
{% endif %}
{% if tools %}Tools: {{ tools | tojson }}
{% endif %}
{% for m in messages if m['role'] != 'system' %}
{% if m['role'] not in ['user', 'assistant'] %}{{ raise_exception('bad role ' + m['role']) }}{% endif %}
[{{ m['role'] | upper }}{% if m.name is defined %}:{{ m.name }}{% endif %}]
{% if m['role'] == 'assistant' %}{% if m.reasoning_content is defined %}<think>{{ m.reasoning_content }}</think>{% endif %}
{% generation %}{{ m['content'] }}{{ eos_token }}{% endgeneration %}
{% else %}{{ m['content'] }}{% endif %}

{% if loop.index >= 99 %}{% break %}{% endif %}
{% endfor %}
{% if add_generation_prompt %}[ASSISTANT]{{ image_token }}{% if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}
{% endif %}
{{ dict(a=ns.n) | tojson }} {{ "é<&>" | tojson }}"""

MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi", "name": "ada"},
    {"role": "assistant", "content": "Hello.", "reasoning": "greet back", "tool_calls": None},
    {"role": "user", "content": "Weather in Paris?"},
]
TOOLS = [{"type": "function", "function": {"name": "weather", "description": "Weather in a city",
                                           "parameters": {"type": "object", "properties": {
                                               "city": {"type": "string"}}}}}]


def _tokenizer_dir(tiny_dir, tmp_path, name, **config):
    """A tokenizer directory (the tiny llama tokenizer) with ``config`` merged into its
    tokenizer_config.json."""
    src = tiny_dir("llama")
    d = tmp_path / name
    d.mkdir()
    shutil.copy(os.path.join(src, "tokenizer.json"), d / "tokenizer.json")
    with open(os.path.join(src, "tokenizer_config.json")) as f:
        cfg = json.load(f)
    cfg.update(config)
    with open(d / "tokenizer_config.json", "w") as f:
        json.dump(cfg, f)
    return str(d)


def _hf(path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


@pytest.fixture
def rich_dir(tiny_dir, tmp_path):
    return _tokenizer_dir(tiny_dir, tmp_path, "rich", chat_template=RICH_TEMPLATE,
                          image_token="<pad>")


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("with_tools", [False, True])
def test_rich_template_matches_transformers(rich_dir, add_generation_prompt, with_tools):
    tools = TOOLS if with_tools else None
    want = _hf(rich_dir).apply_chat_template(MESSAGES, tools=tools, tokenize=False,
                                             add_generation_prompt=add_generation_prompt)
    tmpl = ChatTemplate.from_dir(rich_dir)
    assert tmpl.special_tokens["image_token"] == "<pad>" and tmpl.special_tokens["bos_token"] == "<s>"
    got = tmpl.render(MESSAGES, add_generation_prompt=add_generation_prompt, tools=tools)
    assert got == want
    assert "<think>greet back</think>" in got and '"é<&>"' in got  # reasoning alias; no escaping


def test_extra_variables_and_continue_final_message(rich_dir):
    hf = _hf(rich_dir)
    tmpl = ChatTemplate.from_dir(rich_dir)
    want = hf.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True,
                                  enable_thinking=False)
    assert tmpl.render(MESSAGES, enable_thinking=False) == want and "<think></think>" in want
    prefill = MESSAGES[:3] + [{"role": "assistant", "content": "The weather is"}]
    want = hf.apply_chat_template(prefill, tokenize=False, continue_final_message=True)
    got = tmpl.render(prefill, add_generation_prompt=False, continue_final_message=True)
    assert got == want and got.endswith("The weather is")
    with pytest.raises(ChatTemplateError, match="exclude each other"):
        tmpl.render(prefill, continue_final_message=True)


def test_jinja_file_wins_and_named_templates(tiny_dir, tmp_path):
    d = _tokenizer_dir(tiny_dir, tmp_path, "named", chat_template=[
        {"name": "default", "template": "D{% for m in messages %}|{{ m.content }}{% endfor %}"},
        {"name": "tool_use", "template": "T{{ tools | length }}{{ messages | length }}"},
    ])
    hf, tmpl = _hf(d), ChatTemplate.from_dir(d)
    msgs = MESSAGES[1:2]
    for kw in ({}, {"tools": TOOLS}):
        assert tmpl.render(msgs, **kw) == hf.apply_chat_template(
            msgs, tokenize=False, add_generation_prompt=True, **kw)
    assert tmpl.render(msgs, tools=TOOLS) == "T11"
    assert tmpl.render(msgs, template="default", tools=TOOLS) == "D|Hi"
    with pytest.raises(ChatTemplateError, match="no chat template named 'nope'"):
        tmpl.render(msgs, template="nope")
    with open(os.path.join(d, "chat_template.jinja"), "w") as f:
        f.write("J{{ messages[0].content }}{{ eos_token }}")
    assert ChatTemplate.from_dir(d).render(msgs) == "JHi</s>" == _hf(d).apply_chat_template(
        msgs, tokenize=False, add_generation_prompt=True)
    # sources: a tokenizer_config.json path reads that file only; a .jinja file is the template
    assert render_chat(os.path.join(d, "tokenizer_config.json"), msgs) == "D|Hi"
    assert render_chat(os.path.join(d, "chat_template.jinja"), msgs) == "JHi"
    assert load_chat_template(tmpl) is tmpl


def test_errors_are_typed(tiny_dir, rich_dir, tmp_path):
    bare = _tokenizer_dir(tiny_dir, tmp_path, "bare")
    with pytest.raises(ChatTemplateError, match="has no chat template"):
        ChatTemplate.from_dir(bare)
    tmpl = ChatTemplate.from_dir(rich_dir)
    with pytest.raises(ChatTemplateError, match="refused the messages: bad role tool"):
        tmpl.render([{"role": "tool", "content": "x"}])
    with pytest.raises(ChatTemplateError, match="must be a list"):
        tmpl.render("hello")
    with pytest.raises(ChatTemplateError, match="message 0 must be a dict"):
        tmpl.render(["hello"])
    with pytest.raises(ChatTemplateError, match="does not compile"):
        ChatTemplate.from_string("{% for m in messages %}").render(MESSAGES)
    # the sandbox: no mutation of the caller's data, no underscore namespace attributes
    with pytest.raises(ChatTemplateError, match="refused"):
        ChatTemplate.from_string("{% set x = messages.append(1) %}").render(MESSAGES)
    with pytest.raises(ChatTemplateError, match="underscore"):
        ChatTemplate.from_string("{% set ns = namespace(_x=1) %}").render(MESSAGES)
    with pytest.raises(ChatTemplateError, match="JSON-schema dicts"):
        tmpl.render(MESSAGES, tools=[len])
