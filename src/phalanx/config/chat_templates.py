"""The chat template a run uses instead of the tokenizer's own: `data.chat_template`, a jinja file or a shipped name.

phalanx ships corrected templates for models whose own template loses part of the training data
(`templates/*.jinja` next to this module; each file's first comment line describes it). It lives in `config/`
because a template is a value of the run's config, resolved like a file path: it needs nothing from `data/`
(which renders and masks with the text), and the schema can check it without importing a layer above. The value
is checked when the config is read, so a typo stops `phalanx train`, `launcher` and `slurm` before
any rank starts; the tokenizer loader then puts the text on the tokenizer, and save_pretrained
writes it into every checkpoint and the final output.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any, Optional, Union

from phalanx.errors import ConfigError

FIELD = "data.chat_template"
SUFFIX = ".jinja"
SANDBOX = (
    "transformers renders chat templates in a sandboxed jinja2 environment: jinja's own filters and tests, the tojson "
    "filter, the functions raise_exception, strftime_now, namespace and dict, the break/continue and generation tags; "
    "lists and dicts cannot be changed in place (.append, .update: build them with set or namespace attributes)"
)


class ChatTemplateError(ConfigError):
    """`data.chat_template` names no readable, valid template; `reason` is the message without the field."""

    def __init__(self, value: str, reason: str):
        super().__init__(f"{FIELD} = {value!r}: {reason}")
        self.reason = reason


def _shipped_dir() -> Any:
    return resources.files("phalanx.config").joinpath("templates")


def shipped_templates() -> dict[str, str]:
    """Name -> one-line description of every template phalanx ships, sorted by name."""
    out = {}
    for entry in sorted(_shipped_dir().iterdir(), key=lambda e: e.name):
        if entry.name.endswith(SUFFIX):
            out[entry.name[: -len(SUFFIX)]] = _description(entry.read_text(encoding="utf-8"))
    return out


def _description(text: str) -> str:
    """The first line of the template's opening comment."""
    for line in text.removeprefix("{#-").removeprefix("{#").splitlines():
        if line.strip():
            return line.strip().rstrip("-#}").strip()
    return ""


def resolve_chat_template(value: str) -> Union[str, dict[str, str]]:
    """The template `value` names: a jinja file; a JSON file with a `chat_template` field (a model's
    chat_template.json or tokenizer_config.json); a model or tokenizer folder holding either, or chat_template.jinja;
    else a shipped template's name. A set of named templates (tokenizer_config.json's list, or additional_chat_templates/
    beside chat_template.jinja) comes back as transformers keeps it on a tokenizer, name -> text, with a 'default':
    rows without tools render with that one, rows with tools with 'tool_use' where there is one. ChatTemplateError (a
    ConfigError naming the field, the value, and what is accepted) when it is none of these, or not valid jinja."""
    if not value.strip():
        raise ChatTemplateError(value, f"empty; give the path of a jinja file, or {_accepted()}")
    path = Path(value).expanduser()
    shipped = _shipped_dir() / f"{value}{SUFFIX}"
    if path.is_file():
        text = _read(value, path)
        found = _from_json(value, path, text) if _is_json(path, text) else text
    elif path.is_dir():
        found = _from_folder(value, path)
    elif "/" not in value and shipped.is_file():
        found = _checked(value, shipped.read_text(encoding="utf-8"), f"phalanx's {value}{SUFFIX}")
    else:
        raise ChatTemplateError(
            value,
            f"no such file, and no template phalanx ships has that name.{_nearest(value, path)} Give the path "
            f"of a jinja file, or {_accepted()}",
        )
    if isinstance(found, dict):
        return {name: _checked(value, text, f"{path} ({name!r})") for name, text in found.items()}
    return _checked(value, found, str(path))


def _nearest(value: str, path: Path) -> str:
    """' Did you mean X?' for a mistyped file name or shipped name, or the missing folder; '' when nothing is near."""
    import difflib

    folder = path.parent
    if not folder.is_dir():
        return f" There is no folder {folder}."
    files = {entry.name: str(folder / entry.name) for entry in folder.iterdir() if entry.is_file()}
    if "/" in value:
        near = difflib.get_close_matches(path.name, list(files), n=1)
        return f" Did you mean {files[near[0]]}?" if near else ""
    near = difflib.get_close_matches(value, [*shipped_templates(), *files], n=1)
    return f" Did you mean {files.get(near[0], near[0])}?" if near else ""


def _read(value: str, path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8-sig")  # a leading byte-order mark is not template text
    except (OSError, UnicodeDecodeError) as exc:
        raise ChatTemplateError(value, f"cannot read {path}: {exc}") from None


def _checked(value: str, text: str, where: str) -> str:
    if not text.strip():
        raise ChatTemplateError(value, f"{where} is empty")
    _check_syntax(value, text, where)
    return text


def _is_json(path: Path, text: str) -> bool:
    """A .json file, or a JSON object under another name: a jinja template never parses as one (it opens with text,
    `{{`, `{%` or `{#`)."""
    if path.suffix.lower() == ".json":
        return True
    if not text.lstrip().startswith("{"):
        return False
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False


JSON_FORMS = "a chat_template.json or tokenizer_config.json, whose chat_template field holds the template"


def _from_json(value: str, path: Path, text: str) -> Union[str, dict[str, str]]:
    """The chat_template field of a JSON file: the text, or transformers' list of {name, template} as a dict."""
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise ChatTemplateError(
            value, f"{path} is not valid JSON ({exc}); a JSON template file is {JSON_FORMS}"
        ) from None
    template = data.get("chat_template") if isinstance(data, dict) else None
    if template is None:
        raise ChatTemplateError(
            value, f"{path} has no chat_template field; give a jinja file or {JSON_FORMS} (or {_accepted()})"
        )
    if isinstance(template, str):
        return template
    named = (
        {entry["name"]: entry["template"] for entry in template}
        if isinstance(template, list)
        and template
        and all(
            isinstance(e, dict) and isinstance(e.get("name"), str) and isinstance(e.get("template"), str)
            for e in template
        )
        else None
    )
    if named is None:
        raise ChatTemplateError(
            value, f"{path}: chat_template is neither a template's text nor a list of {{name, template}} objects"
        )
    return _named(value, path, named)


def _named(value: str, where: Path, named: dict[str, str]) -> Union[str, dict[str, str]]:
    if len(named) == 1:
        return next(iter(named.values()))
    if "default" not in named:
        raise ChatTemplateError(
            value,
            f"{where} holds named templates ({', '.join(named)}) and none is named 'default', the one transformers renders "
            "a row without tools with; save the one to train with as a .jinja file and give that",
        )
    return named


def _from_folder(value: str, folder: Path) -> Union[str, dict[str, str]]:
    """A model or tokenizer folder's template, where save_pretrained writes it: chat_template.jinja (with the named
    others in additional_chat_templates/), else chat_template.json, else tokenizer_config.json's field."""
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        others = sorted((folder / "additional_chat_templates").glob(f"*{SUFFIX}"))
        if not others:
            return _read(value, jinja)
        return _named(value, folder, {"default": _read(value, jinja), **{p.stem: _read(value, p) for p in others}})
    for name in ("chat_template.json", "tokenizer_config.json"):
        if (folder / name).is_file():
            return _from_json(value, folder / name, _read(value, folder / name))
    raise ChatTemplateError(
        value,
        f"is a folder with no chat template in it (chat_template.jinja, chat_template.json or tokenizer_config.json); "
        f"give a model or tokenizer folder that has one, a jinja file, or {_accepted()}",
    )


def sandbox_gap(error: Exception) -> Optional[str]:
    """What a template that failed with ``error`` needs that transformers' chat-template sandbox lacks (a filter, test,
    tag or function of another engine, or a change in place); None when the error is about something else (the
    template raised on purpose, or the data does not fit it)."""
    import jinja2

    text = str(error)
    if isinstance(error, jinja2.exceptions.SecurityError):
        return f"it does something the sandbox forbids ({text})"
    missing = re.match(r"No (filter|test) named '([^']+)'", text)
    if missing:
        return f"it uses the jinja {missing[1]} '{missing[2]}', which transformers does not provide"
    tag = re.match(r"Encountered unknown tag '([^']+)'", text)
    if tag and "nesting mistake" not in text:  # a block closed by the wrong end tag is broken jinja, not a gap
        return f"it uses the jinja tag '{tag[1]}', which transformers does not enable"
    if isinstance(error, jinja2.exceptions.TemplateRuntimeError) and "cannot assign attribute on non-namespace" in text:
        # MiroThinker-v1 marks messages and tools as it goes (`{% set message.have_tools = ... %}`).
        return (
            "it sets an attribute of a message, a tool or another mapping ({% set x.name = ... %}), which jinja allows "
            "only on an object made with namespace()"
        )
    if isinstance(error, TypeError) and "Object of type generator is not JSON serializable" in text:
        # llama.cpp's own templates (llama-cpp-deepseek-r1: `tools | map(attribute='function') | tojson`) are written
        # for its engine, whose map gives a list.
        return (
            "it hands tojson a generator (jinja's map, select, reject, selectattr and rejectattr filters give one, where "
            "llama.cpp's template engine gives a list): `| list` before `| tojson` makes it a list"
        )
    name = re.fullmatch(r"'(\w+)' is undefined", text)
    if isinstance(error, jinja2.exceptions.UndefinedError) and name and name[1] not in SPECIAL_TOKEN_NAMES:
        return f"it reads '{name[1]}', which transformers' apply_chat_template does not define"
    return None


# What apply_chat_template hands a template besides the messages: the tokenizer's special tokens (its
# special_tokens_map), those it has. A template that reads one the tokenizer lacks (functionary writes
# `bos_token + ...`; Qwen's tokenizers have no bos) fails as if the name were unknown: the tokenizer lacks it, not
# transformers.
SPECIAL_TOKEN_NAMES = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
    "additional_special_tokens",
)


def unset_special_token(error: Exception) -> Optional[str]:
    """The special token (bos_token, ...) a template failed to read because the tokenizer has none, or None."""
    import jinja2

    name = re.fullmatch(r"'(\w+)' is undefined", str(error))
    if isinstance(error, jinja2.exceptions.UndefinedError) and name and name[1] in SPECIAL_TOKEN_NAMES:
        return name[1]
    return None


def unset_template_variable(error: Exception, template: str) -> Optional[str]:
    """The variable a template failed to read because nothing set it, or None: a name the template reads but never
    calls (firefunction v2 writes `... + functions` and `... + datetime`, which its callers pass to apply_chat_template),
    so data.chat_template_kwargs can set it; a name it calls (`today()`) is a function of another engine instead."""
    import jinja2

    name = re.fullmatch(r"'(\w+)' is undefined", str(error))
    if not (isinstance(error, jinja2.exceptions.UndefinedError) and name) or name[1] in SPECIAL_TOKEN_NAMES:
        return None
    names = _template_names(template)
    return name[1] if names and name[1] in names.read and name[1] not in names.called else None


def _accepted() -> str:
    names = shipped_templates()
    listed = "; ".join(f"{name} ({about})" for name, about in names.items())
    return f"one of the names phalanx ships: {listed}" if names else "(phalanx ships no templates)"


def _check_syntax(value: str, text: str, where: str) -> None:
    """Compile `text` in an environment like the one transformers renders chat templates in, so a broken file is
    reported with its line now."""
    problem = syntax_problem(text)
    if problem:
        raise ChatTemplateError(value, f"{where} {problem}")


def syntax_problem(text: str) -> Optional[str]:
    """Why `text` does not compile as transformers compiles chat templates ("line N is not valid jinja: ...", or what
    its sandbox lacks), None where it compiles."""
    import jinja2

    try:
        _environment().from_string(text)
    except jinja2.TemplateSyntaxError as exc:
        gap = sandbox_gap(exc)
        if gap:
            return f"line {exc.lineno} cannot be rendered by transformers: {gap} ({SANDBOX})"
        return f"line {exc.lineno} is not valid jinja: {exc.message}"
    return None


def own_template_problem(tokenizer: Any) -> Optional[tuple[Optional[str], str]]:
    """(its name, or None for the one template, and why it does not compile) for the first of a tokenizer's own chat
    templates (every named one, in transformers' dict form) that does not compile; None where all do."""
    templates = tokenizer.chat_template
    named = templates.items() if isinstance(templates, dict) else [(None, templates)]
    for name, text in named:
        problem = syntax_problem(text) if isinstance(text, str) else None
        if problem:
            return name, problem
    return None


def own_template_error(source: str, problem: str) -> ConfigError:
    """The error for a model's own chat template that does not compile (`source`: the file it came from)."""
    return ConfigError(
        f"{source} {problem.rstrip('.')}. No row renders with it: fix the template, or give one that compiles with "
        f"{FIELD} (--chat_template FILE|NAME: a jinja or JSON file, a folder, or {_accepted()})"
    )


def template_variables(text: str) -> list[str]:
    """The variables a chat template reads that no rendering sets: its own switches (Qwen3's enable_thinking,
    Apriel's training_prompt, Llama's date_string), which data.chat_template_kwargs can set. Special tokens and what
    apply_chat_template passes are left out; [] for a template that does not compile."""
    names = _template_names(text)
    # A switch is read with a fallback (`x is defined`); jinja's own list of undeclared names also holds names a
    # template sets in one scope and reads in another, which no caller sets.
    return sorted(names.tested & names.free) if names else []


@dataclass(frozen=True)
class _TemplateNames:
    read: frozenset  # every name the template reads
    called: frozenset  # names it calls: functions (`today()`), not values a caller gives
    tested: frozenset  # names it tests with `is defined` / `is undefined`: its switches, read with a fallback
    free: frozenset  # names it reads from its caller, less what apply_chat_template passes and the special tokens


def _template_names(text: str) -> Optional[_TemplateNames]:
    """The names a chat template reads, as above; None when it does not compile (an unknown filter is found only
    then)."""
    import jinja2
    from jinja2 import meta, nodes

    try:
        tree = _environment().parse(text)
        undeclared = meta.find_undeclared_variables(tree)
    except jinja2.TemplateSyntaxError:
        return None
    tested = {
        test.node.name
        for test in tree.find_all(nodes.Test)
        if test.name in ("defined", "undefined") and isinstance(test.node, nodes.Name)
    }
    free = undeclared - TEMPLATE_ARGUMENTS_OF_OURS - {"raise_exception", "strftime_now"}  # transformers' functions
    return _TemplateNames(
        read=frozenset(node.name for node in tree.find_all(nodes.Name) if node.ctx == "load"),
        called=frozenset(call.node.name for call in tree.find_all(nodes.Call) if isinstance(call.node, nodes.Name)),
        tested=frozenset(tested),
        free=frozenset(n for n in free if n not in SPECIAL_TOKEN_NAMES and not n.endswith(("_token", "_tokens"))),
    )


# Which conversations a variable is written into (variables_written_empty): templates that fill in a default system
# prompt write it only where the conversation brings none (Jamba's default_system_message).
EVERY, WITHOUT_SYSTEM, WITH_SYSTEM = "every", "without_system", "with_system"


def variables_written_empty(tokenizer: Any, template_kwargs: Optional[dict[str, Any]] = None) -> dict[str, str]:
    """The variables the tokenizer's chat template writes into its text although nothing sets them, each with the
    conversations it writes it into (EVERY, WITHOUT_SYSTEM, WITH_SYSTEM): jinja writes them as empty text, silently
    (GigaChat 3.5's default system prompt ends "Текущая дата: " + current_date). A name is reported only when an
    exchange rendered with it set is the exchange rendered without it plus its value, so a name the template sets
    itself, tests, or uses to switch a part on, is not. The exchange is tried without and with a system message."""
    template = getattr(tokenizer, "chat_template", None)
    names = _template_names(template_text(template)) if template else None
    if names is None:
        return {}
    kwargs = dict(template_kwargs or {})
    plain = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "hi"}]
    exchanges = {WITHOUT_SYSTEM: plain, WITH_SYSTEM: [{"role": "system", "content": "be brief"}, *plain]}
    unset = {}
    for scope, messages in exchanges.items():
        try:
            unset[scope] = tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)
        except Exception:  # noqa: BLE001 - a template that does not render it is reported elsewhere
            continue
    written: dict[str, str] = {}
    # A special token the tokenizer lacks is undefined to the template too: `{{ bos_token }}` writes nothing (where
    # `bos_token + ...` fails, which is refused elsewhere). The template was written for another tokenizer.
    lacking = {
        n for n in SPECIAL_TOKEN_NAMES if n.endswith("_token") and n in names.read and not getattr(tokenizer, n, None)
    }
    lacking -= names.tested
    for name in sorted((names.free - names.called - names.tested | lacking) - set(kwargs)):
        value = f"<phalanx-probe-{name}>"
        into = []
        for scope, messages in exchanges.items():
            if scope not in unset:
                continue
            try:
                rendered = tokenizer.apply_chat_template(messages, tokenize=False, **{**kwargs, name: value})
            except Exception:  # noqa: BLE001 - it takes no such value: not a text it writes
                continue
            # Written in place and nothing else: unset, the same text with a hole. A name that switches a part on
            # (SmolLM3's custom_instructions, Granite's available_tools) changes more than that and is the
            # template's own option, not a hole.
            if value in rendered and rendered.replace(value, "") == unset[scope]:
                into.append(scope)
        if into:
            written[name] = into[0] if len(into) == 1 and len(unset) == 2 else EVERY
    return written


def written_empty_notes(
    written: dict[str, str], advice: str, rows: str = "row", counts: Optional[dict] = None
) -> list[str]:
    """One sentence per scope for variables_written_empty's result: which names are written as empty text into which
    rows (`counts`: scope -> how many rows here, where known), what to do (`advice`, with {name} for the first name);
    a special token the tokenizer lacks gets its own sentence: only another tokenizer or template gives it."""
    notes = []
    for scope in dict.fromkeys(written.values()):
        into = {
            EVERY: f"every {rows}",
            WITHOUT_SYSTEM: f"{rows}s without a system message",
            WITH_SYSTEM: f"{rows}s with a system message",
        }[scope]
        count = (counts or {}).get(scope)
        into += f" ({count:,} here)" if count is not None and scope != EVERY else ""
        names = [n for n, s in written.items() if s == scope and n not in SPECIAL_TOKEN_NAMES]
        tokens = [n for n, s in written.items() if s == scope and n in SPECIAL_TOKEN_NAMES]
        if names:
            notes.append(
                f"the chat template writes {', '.join(names)} into {into}, and nothing sets "
                f"{'them' if len(names) > 1 else 'it'}: written as empty text ({advice.format(name=names[0])})"
            )
        if tokens:
            notes.append(
                f"the chat template writes {', '.join(tokens)} into {into}, which this tokenizer does not have: written "
                "as empty text (the template was written for a tokenizer with one: use the tokenizer of the model it "
                "belongs to, or a template written for this one, --chat_template FILE|NAME)"
            )
    return notes


def template_text(template: Any) -> str:
    """A tokenizer's chat template as one text, for reading names and markers out of it: the template, or a set of
    named ones (transformers' dict form: 'default', 'tool_use', ...) joined; '' for none."""
    if isinstance(template, dict):
        return "\n".join(str(text) for text in template.values())
    return template or ""


def _environment() -> Any:
    """An environment like the one transformers renders chat templates in: sandboxed, trim_blocks, lstrip_blocks,
    loop controls, {% generation %}, tojson."""
    import jinja2
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):  # transformers' {% generation %} ... {% endgeneration %} marks assistant text
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[Generation, loopcontrols])
    env.filters["tojson"] = json.dumps
    return env


# apply_chat_template's own arguments, which phalanx sets for every rendering: not template variables a user gives.
TEMPLATE_ARGUMENTS_OF_OURS = frozenset(
    (
        "conversation",
        "messages",
        "tools",
        "documents",
        "chat_template",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
    )
)


def template_variables_problem(value: Any) -> Optional[str]:
    """What is wrong with chat-template variables (data.chat_template_kwargs, generate --chat_template_kwargs)."""
    if not isinstance(value, dict):
        return f"{value!r} is not a mapping of template variables, e.g. {{enable_thinking: false}}"
    bad = [key for key in value if not (isinstance(key, str) and key.isidentifier())]
    if bad:
        return f"{bad}: a template variable is a name (letters, digits, _)"
    reserved = sorted(set(value) & TEMPLATE_ARGUMENTS_OF_OURS)
    if reserved:
        return (
            f"{', '.join(reserved)}: set by phalanx for each rendering (the messages, tools and generation prompt "
            "come from the data); give only the template's own variables, e.g. {enable_thinking: false}"
        )
    return None
