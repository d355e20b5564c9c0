"""serving/sealed.py: text a client holds comes back only from a server keyed as the one that sealed it."""

from distributed.serving.sealed import PREFIX, Sealer


def test_servers_sharing_a_token_read_each_others_text():
    text = "the user asked about Paris; ünïcode too"
    token = Sealer("s3cret").seal(text)
    assert token.startswith(PREFIX) and text not in token
    assert Sealer("s3cret").unseal(token) == text  # a restarted ring, or the router and rank 0
    assert Sealer("other").unseal(token) is None


def test_without_a_token_each_sealer_has_its_own_key():
    first, second = Sealer(), Sealer()
    token = first.seal("thought")
    assert first.unseal(token) == "thought" and second.unseal(token) is None


def test_what_is_not_ours_unseals_to_nothing():
    sealer = Sealer("k")
    token = sealer.seal("thought")
    for forged in (token[:-4] + "AAAA", token[:len(PREFIX) + 10], "not sealed", PREFIX + "!!", None, 7):
        assert sealer.unseal(forged) is None, forged
