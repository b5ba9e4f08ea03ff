"""The suite's scheduling on xdist workers (tests/conftest.py): a test that uses a module-scoped
fixture carries its module's `xdist_group`, so one worker builds that fixture once; the slow
end-to-end tests are collected first."""

import pytest


@pytest.fixture(scope="module")
def shared():
  return object()


def test_a_module_fixture_keeps_its_tests_on_one_worker(request, shared):
  group = request.node.get_closest_marker("xdist_group")
  assert group is not None and group.args == (__name__,)


def test_a_test_without_shared_state_is_not_grouped(request):
  assert request.node.get_closest_marker("xdist_group") is None


def test_slow_tests_come_first(request):
  items = request.session.items
  slow = [i for i, item in enumerate(items) if item.get_closest_marker("slow")]
  fast = [i for i, item in enumerate(items) if not item.get_closest_marker("slow")]
  assert fast and request.node in items
  assert not slow or max(slow) < min(fast), "a slow test was collected after a fast one"
