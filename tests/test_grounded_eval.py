"""The labeled extraction sets (examples/grounded) and the script that scores runs on them
(scripts/grounded_eval.py): what the README's accuracy figures are measured with."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import jsonschema
import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
import grounded_eval  # noqa: E402

SETS = [("tickets.jsonl", "labels.jsonl"), ("plain_tickets.jsonl", "plain_labels.jsonl"),
        ("fresh_tickets.jsonl", "fresh_labels.jsonl")]
SPELLINGS = {"ticket.schema.json": {}, "ticket_bare.schema.json": {},
             "ticket_name.schema.json": {"customer": "name"},
             "ticket_alt.schema.json": {"customer": "customer_name", "refund": "refund_requested"}}


@pytest.mark.parametrize(("tickets", "labels"), SETS)
def test_each_label_scores_full_marks_against_itself_and_copies_only_its_ticket(tickets: str, labels: str) -> None:
    texts = {rid: r["text"] for rid, r in grounded_eval.read_jsonl(grounded_eval.HERE / tickets).items()}
    gold = {rid: r["value"] for rid, r in grounded_eval.read_jsonl(grounded_eval.HERE / labels).items()}
    assert set(gold) == set(texts)
    s = grounded_eval.score({rid: {"value": v} for rid, v in gold.items()}, gold, texts)
    assert s["overall"] == 1.0 and s["invented"] == 0 and s["errors"] == 0


@pytest.mark.parametrize("schema", sorted(SPELLINGS))
def test_every_label_is_valid_under_each_spelling_of_the_schema(schema: str) -> None:
    spelled = json.loads((grounded_eval.HERE / schema).read_text())
    for _, labels in SETS:
        for row in grounded_eval.read_jsonl(grounded_eval.HERE / labels).values():
            value = {SPELLINGS[schema].get(k, k): v for k, v in row["value"].items()}
            jsonschema.validate(value, spelled)


def test_an_output_spelled_its_own_way_is_scored_under_the_labels_names(tmp_path: Path,
                                                                         capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "o.jsonl"
    value = {"name": "Clara Jensen", "product": "Nimbus Air Purifier", "order_id": "NB-55102", "refund": True}
    rows = [{"id": "P-01", "value": value}, {"id": "P-02", "error": {"reason": "invalid_output", "message": "x"}}]
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    plain = ["--labels", str(grounded_eval.HERE / "plain_labels.jsonl"),
             "--input", str(grounded_eval.HERE / "plain_tickets.jsonl")]
    assert grounded_eval.main([str(out), *plain, "--rename", "name=customer"]) == 0
    report = capsys.readouterr().out
    assert "customer      5.0%  (1/20)" in report and "records with errors: 1" in report
    assert grounded_eval.main([str(out), *plain]) == 0
    assert "customer      0.0%  (0/20)" in capsys.readouterr().out  # not renamed: the name field is not read
    for bad in (["name"], ["=customer"], ["name="], ["name=customer", "name=client"],
                ["name=customer", "who=customer"], ["customer=name"]):
        with pytest.raises(SystemExit):
            grounded_eval.main([str(out), *plain, *(x for r in bad for x in ("--rename", r))])
    clash = tmp_path / "clash.jsonl"  # both the renamed field and its new name: one would go unscored
    clash.write_text(json.dumps({"id": "P-01", "value": {**value, "customer": "x"}}) + "\n")
    with pytest.raises(SystemExit):
        grounded_eval.main([str(clash), *plain, "--rename", "name=customer"])
