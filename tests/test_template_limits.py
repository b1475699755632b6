"""Template limits (packtool.template_limits): a runaway template rejects its sample with a reason, counted the
same everywhere, or fails the setup in one line when it runs away on the probe; templates that pull in other files
or raise are answered in one line too."""

from __future__ import annotations

import pytest
from support import CHATML, QUICKSTART, chat, routed, template_file

from packtool.chat_templates import load_template
from packtool.config import TrainPolicy
from packtool.errors import PacktoolError, RecordError
from packtool.render import render_chat

# Each runs away only on conversations longer than the one-message probe, so the template loads and
# the sample is rejected; the same text unguarded runs away on the probe and fails the setup.
RUNAWAY = {
    "nested_range_loops": "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
    "nested_string_loops": "{% for i in 'x' * 100000 %}{% for j in 'x' * 100000 %}{% endfor %}{% endfor %}",
    "lipsum": "{{ lipsum(n=200000) }}",
    "power_tower": "{{ 3 ** (3 ** 20) }}",
    "string_times_big": "{{ 'a' * 10 ** 9 }}",
    "macro_recursion": "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}",
    "doubling_concat": (
        "{% set ns = namespace(s='a') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}"
    ),
    "wide_center": "{{ 'a' | center(10 ** 9) }}",
    "multiplying_replace": "{{ ('a' * 100000) | replace('a', 'b' * 100000) }}",
    # filters whose time grows faster than their output: charged as operations
    "urlize_long_text": "{{ ('a b ' * 1000000) | urlize }}",
    "wordwrap_long_word": "{{ ('a' * 200000) | wordwrap(1) }}",  # each cut copies the rest: n*n/2
    "wordwrap_many_words": "{{ ('a ' * 2000000) | wordwrap(1) }}",
    "pprint_long_list": "{{ ('a' * 4000000) | list | pprint }}",
    "unique_long_string": "{{ ('a' * 8000000) | unique | list | length }}",
    # results sized before they are built: widths, precisions, prefixes, tabs
    "indent_wide": "{{ ('a\\n' * 4000000) | indent(1000) }}",
    "expandtabs_wide": "{{ ('\\t' * 4000000).expandtabs(1000) }}",
    "format_width": "{{ '{:>999999999}'.format(1) }}",
    "format_precision": "{{ '{:.999999999f}'.format(1.0) }}",
    "format_map_width": "{{ '{a:>999999999}'.format_map({'a': 1}) }}",
    "format_repeated_field": "{{ ('{0}' * 1000).format('a' * 8000000) }}",
    "percent_width": "{{ '%999999999d' % 1 }}",
    "percent_keyed_width": "{{ '%(a)999999999d' % {'a': 1} }}",
    "percent_precision": "{{ '%.999999999f' % 1.0 }}",
    "format_filter_width": "{{ '%999999999s' | format('a') }}",
    "translate_multiplying": "{{ ('a' * 4000000).translate({97: 'b' * 1000}) }}",
    "integer_squaring": (
        "{% set ns = namespace(x=3) %}{% for i in range(40) %}{% set ns.x = ns.x * ns.x %}{% endfor %}{{ ns.x > 0 }}"
    ),
    # a list or dict nested in itself: a few operations that print as 2**n copies
    "list_doubling_printed": (
        "{% set ns = namespace(x=[1]) %}{% for i in range(40) %}{% set ns.x = [ns.x, ns.x] %}{% endfor %}{{ ns.x }}"
    ),
    "list_doubling_pprint": (
        "{% set ns = namespace(x=[1]) %}{% for i in range(18) %}{% set ns.x = [ns.x, ns.x] %}{% endfor %}"
        "{{ ns.x | pprint }}"
    ),
    "dict_doubling_tojson": (
        "{% set ns = namespace(x={}) %}{% for i in range(40) %}{% set ns.x = {'a': ns.x, 'b': ns.x} %}{% endfor %}"
        "{{ ns.x | tojson }}"
    ),
    "call_doubling": (
        "{% set ns = namespace(x=[1]) %}{% for i in range(40) %}{% set ns.x = dict(a=ns.x, b=ns.x) %}{% endfor %}"
        "{{ ns.x | string }}"
    ),
}


@pytest.mark.timeout(20)  # a regression must fail, not hang: each case takes well under a second
@pytest.mark.parametrize("case", sorted(RUNAWAY))
def test_a_runaway_template_rejects_the_sample_with_a_reason(case, tmp_path):
    guarded = "{% if messages | length > 1 %}" + RUNAWAY[case] + "{% endif %}" + CHATML
    template = load_template(template_file(tmp_path, guarded), {})
    example = chat(("user", "hi"), ("assistant", "hello"))
    for _ in range(2):  # the same verdict every time: limits are counts, not clock time
        with pytest.raises(RecordError) as caught:
            render_chat(example, template, TrainPolicy(), routed(template))
        assert caught.value.kind == "template_limit"
        assert caught.value.reason.startswith("template 't.jinja' stopped at a limit: ")
    # a conversation the runaway branch does not touch still renders
    assert render_chat(chat(("assistant", "alone")), template, TrainPolicy(), routed(template)).text.endswith(
        "alone<|im_end|>\n"
    )


@pytest.mark.timeout(20)
@pytest.mark.parametrize("case", sorted(RUNAWAY))
def test_a_runaway_template_on_the_probe_fails_the_setup_in_one_line(case, tmp_path):
    with pytest.raises(PacktoolError, match="exceeds a template limit on a one-message conversation") as caught:
        load_template(template_file(tmp_path, RUNAWAY[case] + CHATML), {})
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize(
    "tag",
    [
        "{% include 'other.jinja' %}",
        "{% import 'm.jinja' as m %}",
        "{% from 'm.jinja' import f %}",
        "{% extends 'base.jinja' %}",
    ],
)
def test_templates_that_pull_in_other_files_are_refused_in_one_line(tag, tmp_path):
    with pytest.raises(PacktoolError, match=r"line 2: \{% .* %\} is not supported") as caught:
        load_template(template_file(tmp_path, "{# header #}\n" + tag + CHATML), {})
    assert "\n" not in str(caught.value)


def test_a_python_error_inside_the_template_is_a_per_sample_template_error(tmp_path):
    template = load_template(
        template_file(tmp_path, "{% if messages | length > 1 %}{{ 1 / 0 }}{% endif %}" + CHATML), {}
    )
    with pytest.raises(RecordError, match="ZeroDivisionError") as caught:
        render_chat(chat(("user", "hi"), ("assistant", "hello")), template, TrainPolicy(), routed(template))
    assert caught.value.kind == "template_error"


def test_the_cli_answers_a_hostile_template_in_one_line(tmp_path, write_config, write_jsonl):
    from click.testing import CliRunner

    from packtool.cli import main

    write_jsonl([{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}])
    (tmp_path / "t.jinja").write_text("{% include 'x' %}" + CHATML, encoding="utf-8")
    config = write_config(
        {
            "sources": [{"name": "s", "path": "data.jsonl", "format": "messages"}],
            "tokenizer": str(QUICKSTART / "tokenizer"),
            "template": "t.jinja",
            "capacity": 128,
            "output": "out",
        }
    )
    result = CliRunner().invoke(main, ["build", str(config), "-q"])
    assert result.exit_code == 1
    assert "Traceback" not in result.output and "{% include %} is not supported" in result.output


@pytest.mark.timeout(60)
def test_a_template_past_a_limit_fails_the_build_in_one_line_naming_template_limit_and_record(
    tmp_path, write_config, write_jsonl
):
    from click.testing import CliRunner

    from packtool.cli import main

    write_jsonl([{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}])
    runaway = "{% if messages | length > 1 %}{{ '{:>999999999}'.format(1) }}{% endif %}"
    (tmp_path / "t.jinja").write_text(runaway + CHATML, encoding="utf-8")
    config = write_config(
        {
            "sources": [{"name": "s", "path": "data.jsonl", "format": "messages"}],
            "tokenizer": str(QUICKSTART / "tokenizer"),
            "template": "t.jinja",
            "capacity": 128,
            "output": "out",
            "workers": 1,
        }
    )
    result = CliRunner().invoke(main, ["build", str(config), "-q"])
    assert result.exit_code == 1 and "Traceback" not in result.output
    (line,) = result.output.strip().splitlines()
    assert line.startswith("Error: data.jsonl:1") and "template 't.jinja' stopped at a limit" in line, line
    assert "a str.format result of 1,000,000,013 items exceeds the 8,388,608" in line, line
