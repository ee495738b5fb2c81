from ops.tasks import task_world as tw
from ops.policy import tokenizer as tok_lib


def test_tokenizer_keeps_turn_boundaries(tmp_path):
    tok_lib.save_hf_tokenizer(tok_lib.train_tokenizer(512), tmp_path)
    tok = tok_lib.load_hf_tokenizer(tmp_path)
    assert len(tok) == 512
    nl = tok_lib.newline_id(tok)
    for family in tw.FAMILIES:
        task = tw.generate_tasks(family, 1, seed=1)[0]
        whole = tok.encode(tw.solution_text(task))
        parts = tok.encode(tw.prompt_text(task)) + [
            i for _, text in tw.solution_turns(task) for i in tok.encode(text, add_special_tokens=False)
        ]
        assert whole == parts  # tokenizing turn by turn == tokenizing the episode
        assert whole[0] == tok.bos_token_id
        assert whole.count(nl) == 4
        assert tok.decode(whole, skip_special_tokens=True) == tw.solution_text(task)
    digits = tok.convert_ids_to_tokens(tok.encode("RESULT 1234", add_special_tokens=False))
    assert digits[-4:] == ["1", "2", "3", "4"]
