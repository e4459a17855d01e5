import pytest

from preftune.data.prompts import load_prompts
from preftune.errors import UserError
from tests.data import write_csv, write_jsonl, write_parquet

CHAT = [{"role": "user", "content": "2+2?"}]


@pytest.mark.parametrize("name,writer", [("p.parquet", write_parquet), ("p.jsonl", write_jsonl),
                                         ("p.csv", write_csv)])
def test_input_column_and_pass_through(tmp_path, name, writer):
    path = writer(tmp_path / name, [{"input": "a", "answer": "1", "level": "x"},
                                    {"input": "b", "answer": "2", "level": "y"}])
    ps = load_prompts(str(path))
    assert ps.prompts == ["a", "b"] and len(ps) == 2
    assert ps.columns == {"answer": ["1", "2"], "level": ["x", "y"]}
    assert ps.select([1, 0]) == (["b", "a"], {"answer": ["2", "1"], "level": ["y", "x"]})


def test_prompt_column_fallback_and_chat(tmp_path):
    path = write_parquet(tmp_path / "p.parquet", [{"prompt": CHAT, "answer": 4}])
    ps = load_prompts(str(path))
    assert ps.prompts == [CHAT] and ps.columns == {"answer": [4]}


def test_explicit_column_does_not_fall_back(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "a"}])
    with pytest.raises(UserError, match=r"p\.jsonl: missing prompt column 'question'; columns present: prompt"):
        load_prompts(str(path), prompt_column="question")
    assert load_prompts(str(path), prompt_column="prompt").prompts == ["a"]


def test_missing_prompt_column_lists_columns(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [{"text": "a", "answer": 1}])
    with pytest.raises(UserError, match=r"missing prompt column 'input' \(or 'prompt'\); columns present: text, "
                                        r"answer"):
        load_prompts(str(path))


def test_empty_prompt_names_file_and_row(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [{"input": "a"}, {"input": " "}])
    with pytest.raises(UserError, match=r"p\.jsonl row 1 column input: prompt is empty"):
        load_prompts(str(path))


def test_folder_fills_missing_columns(tmp_path):
    write_jsonl(tmp_path / "a.jsonl", [{"input": "a"}])
    write_jsonl(tmp_path / "b.jsonl", [{"input": "b", "answer": 2}])
    ps = load_prompts(str(tmp_path))
    assert ps.prompts == ["a", "b"] and ps.columns == {"answer": [None, 2]}


def test_no_rows_is_error(tmp_path):
    (tmp_path / "p.csv").write_text("input,answer\n")
    with pytest.raises(UserError, match="no prompts"):
        load_prompts(str(tmp_path / "p.csv"))
    (tmp_path / "p.csv").unlink()
    (tmp_path / "p.jsonl").write_text("")
    with pytest.raises(UserError, match="no prompts"):
        load_prompts(str(tmp_path / "p.jsonl"))


def test_csv_values_stay_text(tmp_path):
    (tmp_path / "p.csv").write_text("input,answer\n12,007\nq,1.50\n")
    ps = load_prompts(str(tmp_path / "p.csv"))
    assert ps.prompts == ["12", "q"] and ps.columns == {"answer": ["007", "1.50"]}
