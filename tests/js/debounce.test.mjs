import assert from "node:assert/strict";
import { describe, it, mock } from "node:test";

import { changeWatcher, debounce, sequencer } from "../../web/lib/debounce.js";

/** A manual clock: setTimeout/clearTimeout plus advance(ms). */
function fakeClock() {
  let now = 0;
  let next = 1;
  const timers = new Map();
  return {
    setTimeout(fn, ms) {
      const id = next++;
      timers.set(id, { at: now + ms, fn });
      return id;
    },
    clearTimeout(id) {
      timers.delete(id);
    },
    advance(ms) {
      const end = now + ms;
      for (;;) {
        const due = [...timers.entries()].filter(([, t]) => t.at <= end).sort((a, b) => a[1].at - b[1].at)[0];
        if (!due) break;
        timers.delete(due[0]);
        now = due[1].at;
        due[1].fn();
      }
      now = end;
    },
    get pending() {
      return timers.size;
    },
  };
}

describe("debounce (injected clock)", () => {
  it("runs once, wait ms after the last call, with the last arguments", () => {
    const clock = fakeClock();
    const calls = [];
    const d = debounce((...a) => calls.push(a), 300, clock);
    d(1);
    clock.advance(200);
    d(2);
    clock.advance(299);
    assert.deepEqual(calls, []);
    assert.equal(d.pending(), true);
    clock.advance(1);
    assert.deepEqual(calls, [[2]]);
    assert.equal(d.pending(), false);
    assert.equal(clock.pending, 0);
  });

  it("cancel drops the pending call; flush runs it now", () => {
    const clock = fakeClock();
    const calls = [];
    const d = debounce((x) => calls.push(x), 300, clock);
    d("a");
    d.cancel();
    clock.advance(1000);
    assert.deepEqual(calls, []);
    d("b");
    d.flush();
    assert.deepEqual(calls, ["b"]);
    d.flush(); // nothing pending: no second call
    clock.advance(1000);
    assert.deepEqual(calls, ["b"]);
  });
});

describe("debounce (node:test mock timers)", () => {
  it("uses the global timers when no clock is given", (t) => {
    t.mock.timers.enable({ apis: ["setTimeout"] });
    const fn = t.mock.fn();
    const d = debounce(fn, 300);
    d(1);
    d(2);
    d(3);
    t.mock.timers.tick(299);
    assert.equal(fn.mock.callCount(), 0);
    t.mock.timers.tick(1);
    assert.equal(fn.mock.callCount(), 1);
    assert.deepEqual(fn.mock.calls[0].arguments, [3]);
  });
});

describe("changeWatcher", () => {
  it("schedules onChange only when the read value changes, debounced", () => {
    const clock = fakeClock();
    let value = { width: 832 };
    const seen = [];
    const w = changeWatcher({ read: () => value, onChange: (v) => seen.push(v), wait: 300, clock });
    assert.equal(w.check(), true, "the first read counts as a change");
    clock.advance(300);
    assert.deepEqual(seen, [{ width: 832 }]);
    assert.equal(w.check(), false);
    clock.advance(1000);
    assert.equal(seen.length, 1, "same value: no second call");
    // a drag: several values in quick succession -> one call with the last
    for (const width of [848, 864, 880]) {
      value = { width };
      assert.equal(w.check(), true);
      clock.advance(100);
    }
    assert.equal(seen.length, 1);
    clock.advance(200);
    assert.deepEqual(seen, [{ width: 832 }, { width: 880 }]);
  });

  it("a change back to the old value before the wait still fires (last read wins)", () => {
    const clock = fakeClock();
    let value = 1;
    const seen = [];
    const w = changeWatcher({ read: () => value, onChange: (v) => seen.push(v), wait: 300, clock });
    w.check();
    clock.advance(300);
    value = 2;
    w.check();
    value = 1;
    w.check();
    clock.advance(300);
    assert.deepEqual(seen, [1, 1]);
  });

  it("reset makes the next check fire again; cancel and flush reach the pending call", () => {
    const clock = fakeClock();
    const seen = [];
    const w = changeWatcher({ read: () => "x", onChange: (v) => seen.push(v), wait: 300, clock });
    w.check();
    w.cancel();
    clock.advance(500);
    assert.deepEqual(seen, []);
    assert.equal(w.check(), false);
    w.reset();
    assert.equal(w.check(), true);
    assert.equal(w.pending(), true);
    w.flush();
    assert.deepEqual(seen, ["x"]);
  });

  it("works with node:test mock timers", () => {
    mock.timers.enable({ apis: ["setTimeout"] });
    try {
      let v = 0;
      const fn = mock.fn();
      const w = changeWatcher({ read: () => v, onChange: fn, wait: 300 });
      w.check();
      v = 1;
      mock.timers.tick(150);
      w.check();
      mock.timers.tick(299);
      assert.equal(fn.mock.callCount(), 0);
      mock.timers.tick(1);
      assert.equal(fn.mock.callCount(), 1);
      assert.deepEqual(fn.mock.calls[0].arguments, [1]);
    } finally {
      mock.timers.reset();
    }
  });
});

describe("sequencer", () => {
  it("lets only the latest request win", () => {
    const s = sequencer();
    const a = s.next();
    const b = s.next();
    assert.equal(s.isCurrent(a), false);
    assert.equal(s.isCurrent(b), true);
  });
});
