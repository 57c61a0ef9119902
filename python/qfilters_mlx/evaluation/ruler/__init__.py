"""RULER's synthetic tasks (Hsieh et al. 2024, arXiv:2404.06654), generated offline, scored as
RULER scores them, run over the KV-cache arms, reported in kvpress's leaderboard shape.

:mod:`.haystack` (text sources), :mod:`.tasks` (the generators), :mod:`.prompt` (chat
template, context/question split, fitting a context length), :mod:`.scoring`
(``string_match_all``), :mod:`.arms` (the arms' caches), :mod:`.runner` (one sample, every
arm; the resumable run), :mod:`.report` (leaderboard rows, bootstrap intervals, table, plot).
"""
