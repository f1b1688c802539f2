"""Chat templates: turn a conversation (a list of ``{"role", "content"}`` messages) into the
prompt text a chat model was trained on, with the checkpoint's own Jinja template.

Rendering follows transformers' ``tokenizer.apply_chat_template(messages, tokenize=False)``
(``transformers/utils/chat_template_utils.py``, 5.x) so that a prompt rendered here is the same
string, character for character:

* Where the template comes from (``ChatTemplate.from_dir``): ``chat_template.jinja`` beside the
  tokenizer (plus named ones in ``additional_chat_templates/*.jinja``) replaces
  ``tokenizer_config.json``'s ``"chat_template"`` (a string, or a list of ``{"name",
  "template"}``). With several templates, ``"default"`` is used, or ``"tool_use"`` when tools
  are passed, or the one named by ``template=``.
* The environment: jinja2's ``ImmutableSandboxedEnvironment`` (templates are untrusted code;
  jinja2 >= 3.1.6 because older versions have sandbox escapes) with ``trim_blocks=True``,
  ``lstrip_blocks=True``, the loop-controls extension (``break``/``continue``) and
  ``{% generation %}...{% endgeneration %}`` blocks (rendered as their body); a ``tojson``
  filter that does not HTML-escape (``json.dumps``, ``ensure_ascii=False`` by default); the
  globals ``raise_exception(msg)``, ``strftime_now(fmt)`` (local time), ``dict`` and a
  ``namespace`` that refuses underscore-prefixed attributes.
* The variables: ``messages``, ``add_generation_prompt``, ``tools``, ``documents``, the
  tokenizer's named special tokens from ``tokenizer_config.json`` (``bos_token``,
  ``eos_token``, ``unk_token``, ``sep_token``, ``pad_token``, ``cls_token``, ``mask_token`` and
  model-specific ``*_token`` entries, as strings), then the caller's extra keyword arguments
  (which win over special tokens of the same name, e.g. ``enable_thinking=False``).
* The data: message objects become plain dicts (dataclasses, pydantic ``model_dump``), keys
  whose value is ``None`` are dropped, everything the template sees is rebuilt from plain JSON
  types, and a message's reasoning (``reasoning_content`` / ``thinking`` / ``reasoning``) is
  visible under ``reasoning_content`` and ``thinking``. ``continue_final_message=True`` leaves
  the last message open (no end-of-turn marker) so the model continues it.

Differences from transformers, on purpose: ``add_generation_prompt`` defaults to True here (the
engine renders prompts to answer); tools must be JSON schemas (dicts), not Python functions;
special tokens are read from the checkpoint's files only (a tokenizer class's built-in defaults
are not known here); tokenizing the rendered text is the caller's job and must not add special
tokens again (``Tokenizer.encode(text, add_special_tokens=False)``: the template wrote them).

Usage::

    tmpl = ChatTemplate.from_dir(model_dir)
    prompt = tmpl.render([{"role": "user", "content": "What is the capital of France?"}])
    # or in one call: render_chat(model_dir, messages)
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from typing import Any

from pagedkv.errors import ChatTemplateError

CHAT_TEMPLATE_FILE = "chat_template.jinja"
CHAT_TEMPLATE_DIR = "additional_chat_templates"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
# transformers' PreTrainedTokenizerBase.SPECIAL_TOKENS_ATTRIBUTES
NAMED_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token",
                        "cls_token", "mask_token")
# names a message's reasoning arrives under; templates read the first
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
MIN_JINJA2 = (3, 1, 6)
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "

Message = Mapping[str, Any]


def _token_content(value: Any) -> str | None:
    """A special token as stored in tokenizer_config.json: a string or an AddedToken dict."""
    if isinstance(value, Mapping):
        value = value.get("content")
    return value if isinstance(value, str) else None


def special_tokens_from_config(config: Mapping[str, Any]) -> dict[str, str]:
    """The named special tokens of a parsed ``tokenizer_config.json``, as the template sees
    them: the standard names, then model-specific ``*_token`` entries and the
    ``extra_special_tokens`` mapping (a list there names no variables)."""
    out: dict[str, str] = {}
    for name in NAMED_SPECIAL_TOKENS:
        tok = _token_content(config.get(name))
        if tok is not None:
            out[name] = tok
    for name, value in config.items():
        if name.endswith("_token") and name not in out and isinstance(value, (str, Mapping)):
            tok = _token_content(value)
            if tok is not None:
                out[name] = tok
    extra = config.get("extra_special_tokens")
    if isinstance(extra, Mapping):
        for name, value in extra.items():
            tok = _token_content(value)
            if tok is not None:
                out[str(name)] = tok
    return out


def _read_text(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise ChatTemplateError(f"{path}: cannot read chat template ({type(e).__name__}: {e})") from None


def _read_json(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            d = json.load(f)
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ChatTemplateError(f"{path}: cannot read ({type(e).__name__}: {e})") from None
    if not isinstance(d, dict):
        raise ChatTemplateError(f"{path} must hold a JSON object, got {type(d).__name__}")
    return d


def _templates_from_config(value: Any, source: str) -> dict[str, str]:
    if value is None:
        return {}
    if isinstance(value, str):
        return {"default": value}
    if isinstance(value, list) and all(
            isinstance(t, Mapping) and isinstance(t.get("name"), str)
            and isinstance(t.get("template"), str) for t in value):
        return {t["name"]: t["template"] for t in value}
    raise ChatTemplateError(
        f"{source}: 'chat_template' must be a string or a list of {{'name', 'template'}} objects, "
        f"got {type(value).__name__}")


# ----- the Jinja environment ------------------------------------------------------------------
def _jinja2():
    try:
        import jinja2
        import jinja2.ext
        import jinja2.sandbox
    except ImportError:
        raise ChatTemplateError(
            "chat templates need jinja2 >= 3.1.6: pip install 'jinja2>=3.1.6' "
            "(or pip install 'pagedkv[models]')") from None
    version = tuple(int(p) for p in jinja2.__version__.split(".")[:3] if p.isdigit())
    if version < MIN_JINJA2:
        raise ChatTemplateError(
            f"jinja2 {jinja2.__version__} has known sandbox escapes and chat templates are "
            "untrusted code; upgrade: pip install -U 'jinja2>=3.1.6'")
    return jinja2


def _make_environment():
    jinja2 = _jinja2()
    from jinja2 import nodes
    from jinja2.ext import Extension

    class GenerationBlock(Extension):
        """``{% generation %}...{% endgeneration %}`` marks the assistant's part (transformers
        uses it for assistant masks); rendering it yields the body unchanged."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    class TemplateDict:
        """``dict(...)`` and ``dict.fromkeys(...)`` without exposing the dict type itself."""

        def __call__(self, *args, **kwargs):
            return dict(*args, **kwargs)

        def fromkeys(self, *args, **kwargs):
            return dict.fromkeys(*args, **kwargs)

    def _check_name(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"chat templates cannot store underscore-prefixed attributes on a namespace, "
                f"got {name!r}")

    class TemplateNamespace(jinja2.utils.Namespace):
        """jinja2's ``namespace`` refusing dunder/underscore attributes (no CPython internals)."""

        def __init__(*args, **kwargs):  # jinja2.utils.Namespace's signature trick
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                _check_name(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            _check_name(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    def strftime_now(fmt):
        return datetime.now().strftime(fmt)

    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True,
        extensions=[GenerationBlock, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    env.globals["dict"] = TemplateDict()
    env.globals["namespace"] = TemplateNamespace
    return env


@lru_cache(maxsize=1)
def _environment():
    return _make_environment()


@lru_cache(maxsize=32)
def _compile(source: str, origin: str):
    jinja2 = _jinja2()
    try:
        return _environment().from_string(source)
    except jinja2.exceptions.TemplateSyntaxError as e:
        raise ChatTemplateError(f"{origin}: chat template does not compile: {e} (line {e.lineno})") from None


# ----- the data the template sees -------------------------------------------------------------
def _to_dicts(value: Any) -> Any:
    """Message objects (dataclasses, pydantic models) -> dicts, recursively."""
    if isinstance(value, Mapping):
        return {k: _to_dicts(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_to_dicts(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_to_dicts(v) for v in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _to_dicts(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):
        return _to_dicts(value.model_dump())
    return value


def _plain(value: Any) -> Any:
    """Rebuild ``value`` from plain JSON types, so that the sandboxed template can call no
    method of a caller's object; anything else becomes a ``"<TypeName>"`` placeholder."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    item = getattr(value, "item", None)
    if callable(item) and type(value).__module__ == "numpy":  # numpy scalars
        return _plain(item())
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):
        return _plain(value.model_dump())
    return f"<{type(value).__name__}>"


def normalize_messages(messages: Sequence[Any]) -> list[dict]:
    """The conversation as the template sees it: plain dicts, ``None`` values dropped,
    reasoning visible under ``reasoning_content`` and ``thinking``."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise ChatTemplateError(
            f"messages must be a list of {{'role': ..., 'content': ...}} dicts, got "
            f"{type(messages).__name__}")
    out = []
    for i, m in enumerate(_to_dicts(getattr(messages, "messages", messages))):
        if not isinstance(m, dict):
            raise ChatTemplateError(
                f"message {i} must be a dict (or a dataclass / pydantic model), got {m!r}")
        m = _plain({k: v for k, v in m.items() if v is not None})
        reasoning = next((m[k] for k in REASONING_FIELDS if m.get(k) is not None), None)
        if reasoning is not None:
            m = {"thinking": reasoning, **m, "reasoning_content": reasoning}
        out.append(m)
    return out


def _open_final_message(chat: list[dict], field: str, template: str) -> str:
    """Append the continue tag to the final message's ``field``; returns the original text."""
    if not chat:
        raise ChatTemplateError("continue_final_message is set but the conversation is empty")
    final = chat[-1].get(field)
    if final is None:
        raise ChatTemplateError(
            f"continue_final_message is set but the final message has no {field!r} to continue")
    fields = [field]
    if field in REASONING_FIELDS:  # copied under several names: tag every copy
        fields = [f for f in REASONING_FIELDS if chat[-1].get(f) == final]
    if not any(f in template for f in fields):
        raise ChatTemplateError(
            f"continue_final_message is set to {field!r} but the chat template never reads it")
    if isinstance(final, (list, tuple)):
        for block in reversed(final):
            if isinstance(block, dict) and "text" in block:
                text = block["text"]
                block["text"] = text + _CONTINUE_TAG
                return text
        raise ChatTemplateError(
            "continue_final_message is set but the final message has no text block to continue")
    for f in fields:
        chat[-1][f] = chat[-1][f] + _CONTINUE_TAG
    return final


def _cut_at_tag(rendered: str, final: str) -> str:
    tag = _CONTINUE_TAG.strip()
    if final.strip() not in rendered or tag not in rendered:
        raise ChatTemplateError(
            "continue_final_message is set but the final message does not appear in the rendered "
            "chat (the template drops part of it)")
    loc = rendered.rindex(tag)
    if rendered[loc: loc + len(_CONTINUE_TAG)] == _CONTINUE_TAG:
        return rendered[:loc]
    return rendered[:loc].rstrip()  # the template trimmed the message's trailing space


# ----- the template ---------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class ChatTemplate:
    """A checkpoint's chat template(s) and the special tokens it may print.

    ``templates`` maps a name to Jinja source (``"default"`` for a single template);
    ``special_tokens`` maps variable names (``bos_token`` ...) to token strings; ``source``
    names the file(s) for error messages."""

    templates: Mapping[str, str]
    special_tokens: Mapping[str, str] = dataclasses.field(default_factory=dict)
    source: str = "<string>"

    # ----- construction
    @classmethod
    def from_string(cls, template: str, special_tokens: Mapping[str, str] | None = None,
                    source: str = "<string>") -> "ChatTemplate":
        if not isinstance(template, str):
            raise ChatTemplateError(f"a chat template must be a string, got {type(template).__name__}")
        return cls({"default": template}, dict(special_tokens or {}), source)

    @classmethod
    def from_tokenizer_config(cls, config: Mapping[str, Any] | str | os.PathLike,
                              source: str | None = None) -> "ChatTemplate":
        """From ``tokenizer_config.json`` alone (a path or the parsed dict): its
        ``"chat_template"`` and special tokens."""
        if isinstance(config, (str, os.PathLike)):
            source = source or os.fspath(config)
            config = _read_json(os.fspath(config))
        source = source or TOKENIZER_CONFIG_FILE
        if not isinstance(config, Mapping):
            raise ChatTemplateError(f"{source}: expected a JSON object, got {type(config).__name__}")
        templates = _templates_from_config(config.get("chat_template"), source)
        if not templates:
            raise ChatTemplateError(f"{source} has no 'chat_template'")
        return cls(templates, special_tokens_from_config(config), source)

    @classmethod
    def from_dir(cls, model_dir: str | os.PathLike) -> "ChatTemplate":
        """The template(s) of a checkpoint or tokenizer directory, chosen as transformers'
        ``AutoTokenizer.from_pretrained`` chooses them (see the module docstring)."""
        model_dir = os.fspath(model_dir)
        if not os.path.isdir(model_dir):
            raise ChatTemplateError(f"{model_dir!r} is not a directory")
        cfg_path = os.path.join(model_dir, TOKENIZER_CONFIG_FILE)
        config = _read_json(cfg_path) if os.path.isfile(cfg_path) else {}
        files: dict[str, str] = {}
        jinja_path = os.path.join(model_dir, CHAT_TEMPLATE_FILE)
        if os.path.isfile(jinja_path):
            files["default"] = _read_text(jinja_path)
        extra_dir = os.path.join(model_dir, CHAT_TEMPLATE_DIR)
        if os.path.isdir(extra_dir):
            for name in sorted(os.listdir(extra_dir)):
                if name.endswith(".jinja"):
                    files[name[: -len(".jinja")]] = _read_text(os.path.join(extra_dir, name))
        if files:
            templates, source = files, (jinja_path if "default" in files else extra_dir)
        else:
            templates = _templates_from_config(config.get("chat_template"), cfg_path)
            source = cfg_path
        if not templates:
            raise ChatTemplateError(
                f"{model_dir} has no chat template (neither {CHAT_TEMPLATE_FILE} nor a "
                f"'chat_template' in {TOKENIZER_CONFIG_FILE}); pass prompts as text instead, or "
                "give a template with ChatTemplate.from_string")
        return cls(templates, special_tokens_from_config(config), source)

    # ----- use
    def template_source(self, name: str | None = None, tools: Sequence | None = None) -> str:
        """The Jinja source used for a render: the one named ``name``, else ``tool_use`` when
        tools are given and there is one, else ``default``. (Raw Jinja source is not accepted
        as a name, unlike transformers' ``chat_template=``: use ``ChatTemplate.from_string``.)"""
        if name is not None:
            if name in self.templates:
                return self.templates[name]
            raise ChatTemplateError(
                f"{self.source}: no chat template named {name!r}; choose one of "
                f"{', '.join(sorted(self.templates))}")
        if tools is not None and "tool_use" in self.templates:
            return self.templates["tool_use"]
        if "default" in self.templates:
            return self.templates["default"]
        raise ChatTemplateError(
            f"{self.source} has several chat templates and none is 'default'; pass template= "
            f"one of {', '.join(sorted(self.templates))}")

    def render(self, messages: Sequence[Message], add_generation_prompt: bool = True, *,
               tools: Sequence[Mapping] | None = None, documents: Sequence[Mapping] | None = None,
               continue_final_message: bool | str = False, template: str | None = None,
               **extra: Any) -> str:
        """The prompt text of ``messages``. ``add_generation_prompt`` appends the header that
        opens the assistant's turn (the default here: the engine answers);
        ``continue_final_message`` (True, or the field name) leaves the last message open
        instead, and excludes ``add_generation_prompt``; ``tools`` / ``documents`` are passed
        to templates that support them (JSON-schema dicts); ``extra`` keyword arguments become
        template variables (e.g. ``enable_thinking=False``)."""
        jinja2 = _jinja2()
        if continue_final_message and add_generation_prompt:
            raise ChatTemplateError(
                "continue_final_message and add_generation_prompt exclude each other: continue the "
                "final message, or open a new assistant turn (pass add_generation_prompt=False "
                "with continue_final_message)")
        if tools is not None:
            if isinstance(tools, (str, bytes, Mapping)) or not isinstance(tools, Sequence):
                raise ChatTemplateError("tools must be a list of JSON-schema dicts")
            if not all(isinstance(t, Mapping) for t in tools):
                raise ChatTemplateError(
                    "tools must be JSON-schema dicts (Python functions are not converted here)")
        if documents is not None and not all(isinstance(d, Mapping) for d in documents):
            raise ChatTemplateError("documents must be dicts (with 'title' and 'text' keys)")
        source = self.template_source(template, tools)
        compiled = _compile(source, self.source)
        chat = normalize_messages(messages)
        final = None
        if continue_final_message:
            field = continue_final_message if isinstance(continue_final_message, str) else "content"
            final = _open_final_message(chat, field, source)
        variables = _plain({**self.special_tokens, **extra})
        try:
            rendered = compiled.render(messages=chat, tools=_plain(tools),
                                       documents=_plain(documents),
                                       add_generation_prompt=add_generation_prompt, **variables)
        except jinja2.exceptions.TemplateError as e:
            raise ChatTemplateError(f"{self.source}: the chat template refused the messages: {e}") from None
        if final is not None:
            rendered = _cut_at_tag(rendered, final)
        return rendered


def load_chat_template(source: "ChatTemplate | str | os.PathLike | Mapping[str, Any]") -> ChatTemplate:
    """A ``ChatTemplate`` from a checkpoint directory, a ``tokenizer_config.json`` path, a
    ``.jinja`` file, a parsed tokenizer config dict, or a ``ChatTemplate`` (returned as is)."""
    if isinstance(source, ChatTemplate):
        return source
    if isinstance(source, Mapping):
        return ChatTemplate.from_tokenizer_config(source)
    if isinstance(source, (str, os.PathLike)):
        path = os.fspath(source)
        if os.path.isdir(path):
            return ChatTemplate.from_dir(path)
        if os.path.isfile(path):
            if path.endswith(".jinja"):
                return ChatTemplate.from_string(_read_text(path), source=path)
            return ChatTemplate.from_tokenizer_config(path)
        raise ChatTemplateError(f"{path!r} is neither a directory nor a file")
    raise ChatTemplateError(
        f"a chat template source must be a directory, a file path, a tokenizer config dict or a "
        f"ChatTemplate, got {type(source).__name__}")


def render_chat(source: "ChatTemplate | str | os.PathLike | Mapping[str, Any]",
                messages: Sequence[Message], add_generation_prompt: bool = True,
                **kwargs: Any) -> str:
    """One call: ``load_chat_template(source).render(messages, add_generation_prompt,
    **kwargs)``. Loading is cheap (two small files; compiled templates are cached), but a
    caller rendering many conversations should keep the ``ChatTemplate``."""
    return load_chat_template(source).render(messages, add_generation_prompt, **kwargs)


__all__ = [
    "CHAT_TEMPLATE_DIR",
    "CHAT_TEMPLATE_FILE",
    "ChatTemplate",
    "load_chat_template",
    "normalize_messages",
    "render_chat",
    "special_tokens_from_config",
]
