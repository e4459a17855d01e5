import pytest

from preftune.data.traces import load_traces
from preftune.errors import UserError
from tests.data import rows, write_parquet
from tests.s3_server import s3_server

pytest.importorskip("s3fs")
pytest.importorskip("moto")


@pytest.fixture(scope="module")
def s3():
    with s3_server() as endpoint:
        yield endpoint


def test_folder_of_parquet_from_s3(s3, tmp_path):
    fs = s3.filesystem()
    for name, data in [("b.parquet", rows(("p2", "r", 0.2))), ("a.parquet", rows(("p1", "r", 0.1)))]:
        fs.put_file(str(write_parquet(tmp_path / name, data)), f"{s3.bucket}/traces/{name}")
    fs.pipe_file(f"{s3.bucket}/traces/_SUCCESS", b"")
    traces, report = load_traces(s3.url("traces/"))
    assert [t.prompt for t in traces] == ["p1", "p2"]
    assert traces[0].source == s3.url("traces/a.parquet")
    assert report.files == 2 and report.kept == 2


def test_missing_s3_path_is_user_error(s3):
    with pytest.raises(UserError, match="no such file or folder"):
        load_traces(s3.url("nothing/here.parquet"))


def test_row_error_names_s3_file(s3, tmp_path):
    fs = s3.filesystem()
    fs.put_file(str(write_parquet(tmp_path / "bad.parquet", rows(("p", "", 0.5)))), f"{s3.bucket}/bad/x.parquet")
    with pytest.raises(UserError, match=r"s3://test-bucket/bad/x\.parquet row 0 column output"):
        load_traces(s3.url("bad/x.parquet"))
