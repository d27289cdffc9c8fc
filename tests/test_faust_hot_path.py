"""The featurizer's Faust transport is found through its entry point (a reinstall-or-fail packaging
fact: without it `adstream stream` cannot start), and the app is built on it with the quiet monitor."""

from faust.transport import by_url

from stream.featurizer.app import build_app
from stream.featurizer.faust_hot_path import Consumer, QuietMonitor, Transport
from stream.kafka.settings import KafkaSettings
from stream.settings import StreamSettings


def test_the_adstream_transport_is_faust_aiokafka_with_the_cheap_delivery():
    assert by_url("adstream://127.0.0.1:9092") is Transport
    assert Transport.Consumer is Consumer


def test_the_featurizer_app_uses_it():
    app = build_app(KafkaSettings(), StreamSettings())
    assert app.conf.broker[0].scheme == "adstream"
    assert isinstance(app.monitor, QuietMonitor)
