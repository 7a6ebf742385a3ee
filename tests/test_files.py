"""The strict file loader (torchrec_sparselift/files.py) and atomic writes that follow the umask.

Every broken file gives one ``FileFormatError`` on one line naming the file and, for a field,
its path; arbitrary bytes and arbitrary JSON values never let another exception type escape."""

from __future__ import annotations

import json
import os
import stat
import threading

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from torchrec_sparselift.atomic import write_bytes, write_json, write_text
from torchrec_sparselift.errors import FileFormatError, PlanFormatError
from torchrec_sparselift.files import INT64_MAX, Fields, load_json, load_structured, parse_json

JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True, allow_infinity=True) | st.text(),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=12,
)


def _one_line(e: BaseException) -> str:
    msg = str(e)
    assert "\n" not in msg, msg
    return msg


def _write(tmp_path, name: str, data: bytes) -> str:
    p = tmp_path / name
    p.write_bytes(data)
    return str(p)


# -- the loader ------------------------------------------------------------------------------


def test_missing_file_is_named(tmp_path):
    with pytest.raises(FileFormatError, match=r"profile .*nope\.json: does not exist"):
        load_json(str(tmp_path / "nope.json"), what="profile")


def test_directory_is_refused_by_name(tmp_path):
    with pytest.raises(FileFormatError, match="is a directory"):
        load_json(str(tmp_path))


def test_unreadable_file_is_named(tmp_path):
    p = _write(tmp_path, "secret.json", b"{}")
    os.chmod(p, 0)
    try:
        if os.access(p, os.R_OK):
            pytest.skip("running as root: permissions are not enforced")
        with pytest.raises(FileFormatError, match="secret.json: cannot be read .permission denied"):
            load_json(p)
    finally:
        os.chmod(p, 0o644)


def test_non_utf8_names_the_byte_offset_and_line(tmp_path):
    p = _write(tmp_path, "t.json", b'{"a": 1,\n "b": "\xff"}')
    with pytest.raises(FileFormatError) as e:
        load_json(p, what="table file")
    msg = _one_line(e.value)
    assert "table file" in msg and "t.json" in msg and "offset 16" in msg and "line 2" in msg and "0xff" in msg
    assert e.value.path == p


def test_truncated_json_names_line_and_column(tmp_path):
    p = _write(tmp_path, "plan.json", b'{"tables": [\n  {"name": "t0", "rows": 10')
    with pytest.raises(FileFormatError) as e:
        load_json(p)
    msg = _one_line(e.value)
    assert "plan.json: is not valid JSON" in msg and "line 2" in msg and "truncated" in msg


def test_empty_file_is_named(tmp_path):
    with pytest.raises(FileFormatError, match="e.json: is empty"):
        load_json(_write(tmp_path, "e.json", b"  \n"))


def test_duplicate_key_is_refused_naming_key_and_file(tmp_path):
    p = _write(tmp_path, "t.json", b'[{"name": "t0", "rows": 1000, "dim": 8, "rows": 5000000}]')
    with pytest.raises(FileFormatError) as e:
        load_json(p)
    msg = _one_line(e.value)
    assert "t.json" in msg and "duplicate key 'rows'" in msg and "'t0'" in msg


def test_top_level_of_the_wrong_type(tmp_path):
    with pytest.raises(FileFormatError, match=r"p.json: top level must be an object .*got a list"):
        load_json(_write(tmp_path, "p.json", b"[1, 2]"), top=dict)


def test_a_byte_order_mark_is_accepted(tmp_path):
    assert load_json(_write(tmp_path, "b.json", b'\xef\xbb\xbf{"a": 1}')) == {"a": 1}


def test_huge_integer_literal_is_a_file_error(tmp_path):
    with pytest.raises(FileFormatError, match="h.json"):
        load_json(_write(tmp_path, "h.json", b"[" + b"9" * 5000 + b"]"))


def test_deep_nesting_is_a_file_error(tmp_path):
    with pytest.raises(FileFormatError, match="nested too deeply"):
        load_json(_write(tmp_path, "d.json", b"[" * 100000 + b"]" * 100000))


def test_yaml_goes_through_the_same_checks(tmp_path):
    pytest.importorskip("yaml")
    assert load_structured(_write(tmp_path, "t.yaml", b"a: 1\nb: [1, 2]\n")) == {"a": 1, "b": [1, 2]}
    with pytest.raises(FileFormatError, match=r"t2.yaml: duplicate key 'rows' at line 3"):
        load_structured(_write(tmp_path, "t2.yaml", b"name: t0\nrows: 1\nrows: 2\n"))
    with pytest.raises(FileFormatError, match=r"t3.yaml: is not valid YAML"):
        load_structured(_write(tmp_path, "t3.yaml", b"a: [1, 2\n"))
    with pytest.raises(FileFormatError, match=r"t4.yaml: is not UTF-8"):
        load_structured(_write(tmp_path, "t4.yaml", b"a: \xfe\n"))
    with pytest.raises(FileFormatError, match=r"t5.yaml: top level must be a list"):
        load_structured(_write(tmp_path, "t5.yaml", b"a: 1\n"), top=list)


def test_plan_format_error_is_a_file_format_error():
    assert issubclass(PlanFormatError, FileFormatError) and issubclass(FileFormatError, ValueError)


# -- fields ----------------------------------------------------------------------------------


def _fields(data, path="tables[3]"):
    return Fields(data, file="t.json", what="table file", path=path)


def test_fields_name_file_and_path_and_the_fix():
    f = _fields({"rows": 1e30, "name": "t"})
    with pytest.raises(FileFormatError) as e:
        f.req("rows", int, lo=1)
    msg = _one_line(e.value)
    assert msg.startswith("table file t.json: tables[3].rows: must be an integer in 1..9223372036854775807")
    assert "1e+30 (a float)" in msg and "to fix:" in msg


@pytest.mark.parametrize("value, ok", [
    (INT64_MAX, True), (INT64_MAX + 1, False), (0, False), (True, False), ("5", False), (5.0, False), (7, True),
])
def test_int_fields_are_whole_and_int64_bounded(value, ok):
    f = _fields({"rows": value})
    if ok:
        assert f.req("rows", int, lo=1) == value
    else:
        with pytest.raises(FileFormatError, match=r"tables\[3\].rows"):
            f.req("rows", int, lo=1)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -1.0, 10**400, "1", None, [1]])
def test_float_fields_refuse_non_finite_negative_and_non_numbers(value):
    f = _fields({"x": value})
    with pytest.raises(FileFormatError, match=r"tables\[3\].x"):
        f.req("x", float, lo=0.0)


def test_missing_field_and_unknown_keys_and_nested_paths():
    f = Fields({"modules": {"sparse.ebc": {"params": {"t0": {"ranks": [0, "x"]}}}}}, file="p.json", what="plan")
    with pytest.raises(FileFormatError, match=r"plan p.json: schema: is missing; to fix: add 'schema'"):
        f.req("schema", str)
    ((key, m),) = f.mapping("modules")
    assert key == "sparse.ebc"
    ((_, ps),) = m.mapping("params")
    with pytest.raises(FileFormatError, match=r'modules\["sparse.ebc"\].params.t0.ranks\[1\]: must be an integer'):
        ps.values("ranks", int, lo=0)
    with pytest.raises(FileFormatError, match=r"unknown key\(s\) \['ranks'\]; allowed: a, b"):
        ps.only(["a", "b"])
    with pytest.raises(FileFormatError, match=r"tables\[0\]: must be an object"):
        Fields({"tables": [3]}, file="t.json").objs("tables")


def test_choices_and_lengths():
    f = _fields({"k": "fussed", "pf": [1.0, 2.0]})
    with pytest.raises(FileFormatError, match=r"must be one of \['fused', 'dense'\], got 'fussed'"):
        f.req("k", str, choices=["fused", "dense"])
    with pytest.raises(FileFormatError, match=r"pf: must have 3 element"):
        f.values("pf", float, length=3)


def test_a_custom_error_type_is_raised_when_asked():
    with pytest.raises(PlanFormatError):
        Fields({}, file="p.json", error=PlanFormatError).req("x", int)


# -- properties: nothing but FileFormatError escapes -----------------------------------------


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(raw=st.binary(max_size=200))
def test_arbitrary_bytes_give_data_or_a_file_format_error(tmp_path, raw):
    p = _write(tmp_path, "x.json", raw)
    try:
        load_json(p, top=dict)
    except FileFormatError as e:
        assert "x.json" in _one_line(e)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(raw=st.binary(max_size=200))
def test_arbitrary_bytes_as_yaml_give_data_or_a_file_format_error(tmp_path, raw):
    pytest.importorskip("yaml")
    p = _write(tmp_path, "x.yaml", raw)
    try:
        load_structured(p)
    except FileFormatError as e:
        assert "x.yaml" in _one_line(e)


@settings(max_examples=300, deadline=None)
@given(value=JSON_VALUES, kind=st.sampled_from([int, float, str, bool, list, dict]))
def test_any_value_in_any_field_gives_the_value_or_a_file_format_error(value, kind):
    f = Fields({"x": value, "y": [value]}, file="f.json")
    for read in (lambda: f.req("x", kind, lo=0), lambda: f.opt("x", kind, nonempty=True),
                 lambda: f.values("y", kind), lambda: f.obj("x"), lambda: f.objs("y"), lambda: f.mapping("x")):
        try:
            read()
        except FileFormatError as e:
            assert "f.json" in _one_line(e)


@settings(max_examples=200, deadline=None)
@given(text=st.text(max_size=80))
def test_arbitrary_text_parses_or_gives_a_file_format_error(text):
    try:
        parse_json(text, "s.json")
    except FileFormatError as e:
        assert "s.json" in _one_line(e)


# -- atomic writes follow the umask ----------------------------------------------------------

_UMASK_LOCK = threading.Lock()


@pytest.mark.parametrize("umask, mode", [(0o022, 0o644), (0o077, 0o600), (0o002, 0o664), (0o000, 0o666)])
@pytest.mark.parametrize("writer", ["json", "text", "bytes"])
def test_atomic_writes_follow_the_umask(tmp_path, umask, mode, writer):
    path = str(tmp_path / "sub" / "out.json")
    with _UMASK_LOCK:
        old = os.umask(umask)
        try:
            {"json": lambda: write_json(path, {"a": 1}),
             "text": lambda: write_text(path, "{}"),
             "bytes": lambda: write_bytes(path, b"{}", fsync=True)}[writer]()
        finally:
            os.umask(old)
    assert stat.S_IMODE(os.stat(path).st_mode) == mode
    assert [n for n in os.listdir(tmp_path / "sub")] == ["out.json"], "no temporary file is left behind"


def test_atomic_write_replaces_whole_and_cleans_up_on_failure(tmp_path):
    path = str(tmp_path / "p.json")
    write_json(path, {"v": 1})
    with pytest.raises(TypeError):
        write_bytes(path, "text, not bytes")  # fails after the temporary file exists
    assert json.loads(open(path).read()) == {"v": 1}
    assert os.listdir(tmp_path) == ["p.json"]
