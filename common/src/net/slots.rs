//! The table of calls in flight on one multiplexed connection, by request id: what the
//! broker's upstream connections and the driver's connections keep to match each reply to
//! its call.
//!
//! A request id is `generation << 32 | slot index`: the slot index finds the entry without
//! hashing, and the generation, bumped on every insert, makes a reply for a slot that was
//! freed and reused (a late reply to a call that timed out) miss instead of hitting a
//! stranger. Slots are reused through a free list, so the table grows to the most calls
//! ever in flight at once and allocates nothing after that.
//!
//! A keyed table ([`SlotTable::keyed`], the broker's upstream connections) leaves the id
//! to its caller: it hands out a 32-bit key, `generation << 16 | slot index` (at most
//! [`KEYED_SLOTS`] calls at once), which the caller puts in the id's low 32 bits, the rest
//! its own (`rpcmesh_wire::neutral`); the table keeps the whole id and matches it whole.

/// Most calls a keyed table holds at once: its key has 16 bits of slot index.
pub const KEYED_SLOTS: usize = 1 << 16;

/// Calls in flight, by request id; each entry holds what the caller keeps about its call.
#[derive(Debug, Clone)]
pub struct SlotTable<T> {
    slots: Vec<Option<(u64, T)>>,
    /// Empty slots, reused first.
    free: Vec<u32>,
    generation: u32,
    /// The ids are the caller's, around a 32-bit key ([`SlotTable::keyed`]).
    keyed: bool,
}

impl<T> Default for SlotTable<T> {
    fn default() -> Self {
        SlotTable::with_capacity(0)
    }
}

impl<T> SlotTable<T> {
    /// An empty table with room for `n` calls before it allocates.
    pub fn with_capacity(n: usize) -> Self {
        SlotTable {
            slots: Vec::with_capacity(n),
            free: Vec::with_capacity(n),
            generation: 0,
            keyed: false,
        }
    }

    /// An empty keyed table: calls go in with [`SlotTable::insert_keyed`] only.
    pub fn keyed() -> Self {
        SlotTable {
            keyed: true,
            ..SlotTable::with_capacity(0)
        }
    }

    /// Stores `value` under the id `id_of` makes of a fresh key (`generation << 16 | slot
    /// index`, to go in the id's low 32 bits); returns the id and the value stored. `None`
    /// when [`KEYED_SLOTS`] calls are in the table already.
    pub fn insert_keyed(
        &mut self,
        value: T,
        id_of: impl FnOnce(u32) -> u64,
    ) -> Option<(u64, &mut T)> {
        debug_assert!(self.keyed, "insert_keyed on a table of plain ids");
        let idx = match self.free.pop() {
            Some(i) => i,
            None if self.slots.len() < KEYED_SLOTS => {
                self.slots.push(None);
                (self.slots.len() - 1) as u32
            }
            None => return None,
        };
        self.generation = self.generation.wrapping_add(1);
        let key = ((self.generation & 0xffff) << 16) | idx;
        let id = id_of(key);
        debug_assert_eq!(id as u32, key, "the key goes in the id's low 32 bits");
        let (_, stored) = self.slots[idx as usize].insert((id, value));
        Some((id, stored))
    }

    /// Stores `value` under a fresh request id, and returns the id.
    pub fn insert(&mut self, value: T) -> u64 {
        self.insert_mut(value).0
    }

    /// As [`SlotTable::insert`], and the value stored, for a caller that writes its call
    /// out under the new id from what it just stored.
    pub fn insert_mut(&mut self, value: T) -> (u64, &mut T) {
        debug_assert!(!self.keyed, "insert on a keyed table");
        self.generation = self.generation.wrapping_add(1);
        let idx = match self.free.pop() {
            Some(i) => i,
            None => {
                self.slots.push(None);
                (self.slots.len() - 1) as u32
            }
        };
        let id = (u64::from(self.generation) << 32) | u64::from(idx);
        let (_, stored) = self.slots[idx as usize].insert((id, value));
        (id, stored)
    }

    /// Takes the call with request id `id` out of the table; `None` when there is none (its
    /// slot is empty, or holds a later call).
    pub fn take(&mut self, id: u64) -> Option<T> {
        self.take_if(id, |_| true)
    }

    /// Takes the call with request id `id` out of the table if `pred` holds for it; `None`
    /// (and the call stays) otherwise, or when there is no such call.
    pub fn take_if(&mut self, id: u64, pred: impl FnOnce(&T) -> bool) -> Option<T> {
        let idx = self.slot_of(id);
        let entry = self.slots.get_mut(idx)?;
        if entry.as_ref().is_some_and(|(i, v)| *i == id && pred(v)) {
            self.free.push(idx as u32);
            entry.take().map(|(_, v)| v)
        } else {
            None
        }
    }

    /// The call with request id `id`, if it is in the table.
    pub fn get_mut(&mut self, id: u64) -> Option<&mut T> {
        let idx = self.slot_of(id);
        match self.slots.get_mut(idx)? {
            Some((i, v)) if *i == id => Some(v),
            _ => None,
        }
    }

    /// Takes out every call for which `pred` holds (e.g. past its deadline), appending
    /// them to `out` with their ids, in slot order.
    pub fn take_where(&mut self, mut pred: impl FnMut(&T) -> bool, out: &mut Vec<(u64, T)>) {
        for (idx, entry) in self.slots.iter_mut().enumerate() {
            if entry.as_ref().is_some_and(|(_, v)| pred(v)) {
                out.extend(entry.take());
                self.free.push(idx as u32);
            }
        }
    }

    /// Every call in the table, to change in place (e.g. to let go of what it holds).
    pub fn values_mut(&mut self) -> impl Iterator<Item = &mut T> + '_ {
        self.slots.iter_mut().flatten().map(|(_, v)| v)
    }

    /// Takes out every call (the connection is gone), with its id; the table keeps its
    /// memory for the next connection.
    pub fn drain(&mut self) -> impl Iterator<Item = (u64, T)> + '_ {
        self.free.clear();
        self.slots.drain(..).flatten()
    }

    /// Calls in the table: the slots that are not free.
    pub fn len(&self) -> usize {
        self.slots.len() - self.free.len()
    }

    /// True when no call is in the table.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl<T> SlotTable<T> {
    /// The slot index part of a request id.
    fn slot_of(&self, id: u64) -> usize {
        if self.keyed {
            (id & 0xffff) as usize
        } else {
            (id & 0xffff_ffff) as usize
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_call_is_found_by_its_id_once() {
        let mut t = SlotTable::default();
        let a = t.insert("a");
        let b = t.insert("b");
        assert_ne!(a, b);
        assert_eq!(t.len(), 2);
        assert_eq!(t.get_mut(b).copied(), Some("b"));
        assert_eq!(t.take(a), Some("a"));
        assert_eq!(t.take(a), None, "taken once");
        assert_eq!(t.len(), 1);
    }

    #[test]
    fn take_if_leaves_a_call_the_test_refuses_and_insert_mut_gives_what_it_stored() {
        let mut t = SlotTable::default();
        let (a, stored) = t.insert_mut(1);
        *stored += 1;
        assert_eq!(t.take_if(a, |v| *v > 5), None, "refused: it stays");
        assert_eq!(t.len(), 1);
        assert_eq!(
            t.take_if(a + (1 << 32), |_| true),
            None,
            "another generation"
        );
        assert_eq!(t.take_if(a, |v| *v == 2), Some(2));
        assert!(t.is_empty());
    }

    #[test]
    fn a_late_reply_for_a_reused_slot_misses() {
        let mut t = SlotTable::default();
        let old = t.insert(1);
        assert_eq!(t.take(old), Some(1));
        let new = t.insert(2);
        assert_eq!(new & 0xffff_ffff, old & 0xffff_ffff, "the slot is reused");
        assert_eq!(t.take(old), None, "the old id does not reach the new call");
        assert!(t.get_mut(old).is_none());
        assert_eq!(t.take(new), Some(2));
    }

    #[test]
    fn values_can_be_changed_in_place_and_stay_under_their_ids() {
        let mut t = SlotTable::default();
        let a = t.insert(1);
        let b = t.insert(2);
        assert_eq!(t.take(a), Some(1));
        for v in t.values_mut() {
            *v += 10;
        }
        assert_eq!(t.take(b), Some(12));
        assert_eq!(t.values_mut().count(), 0);
    }

    #[test]
    fn ids_of_no_slot_miss_without_panicking() {
        let mut t: SlotTable<u8> = SlotTable::default();
        assert_eq!(t.take(u64::MAX), None);
        assert_eq!(t.take(12345), None);
        assert!(t.is_empty());
    }

    #[test]
    fn a_keyed_table_keeps_the_callers_ids_and_matches_them_whole() {
        let mut t = SlotTable::keyed();
        let (a, _) = t.insert_keyed("a", |key| 7 << 32 | u64::from(key)).unwrap();
        assert_eq!(a >> 32, 7);
        assert_eq!(t.take(a ^ (1 << 40)), None, "same key, another id");
        assert_eq!(t.take(a), Some("a"));
        let (b, _) = t.insert_keyed("b", u64::from).unwrap();
        assert_eq!(b & 0xffff, a & 0xffff, "the slot is reused");
        assert_ne!(b & 0xffff_0000, a & 0xffff_0000, "under a new generation");
        assert_eq!(t.take(a), None);
        assert_eq!(t.take(b), Some("b"));
    }

    #[test]
    fn a_keyed_table_holds_at_most_its_keys_slots() {
        let mut t = SlotTable::keyed();
        for i in 0..KEYED_SLOTS {
            assert!(t.insert_keyed(i, u64::from).is_some());
        }
        assert!(t.insert_keyed(0, u64::from).is_none());
        assert_eq!(t.len(), KEYED_SLOTS);
    }

    #[test]
    fn the_table_grows_to_the_most_in_flight_and_no_further() {
        let mut t = SlotTable::with_capacity(4);
        for round in 0..100u32 {
            let ids: Vec<u64> = (0..4).map(|i| t.insert(round * 4 + i)).collect();
            for id in ids {
                assert!(t.take(id).is_some());
            }
        }
        assert_eq!(t.slots.len(), 4);
        assert!(t.is_empty());
    }

    #[test]
    fn take_where_takes_exactly_the_matching_calls() {
        let mut t = SlotTable::default();
        let ids: Vec<u64> = (0..10).map(|v| t.insert(v)).collect();
        let mut out = Vec::new();
        t.take_where(|v| v % 3 == 0, &mut out);
        let taken: Vec<i32> = out.iter().map(|(_, v)| *v).collect();
        assert_eq!(taken, [0, 3, 6, 9]);
        assert_eq!(out[1].0, ids[3]);
        assert_eq!(t.len(), 6);
        assert_eq!(t.take(ids[3]), None);
        assert_eq!(t.take(ids[4]), Some(4));
        // A freed slot takes a new call.
        let again = t.insert(42);
        assert_eq!(t.take(again), Some(42));
    }

    #[test]
    fn drain_empties_the_table() {
        let mut t = SlotTable::default();
        let a = t.insert('a');
        t.insert('b');
        let mut all: Vec<char> = t.drain().map(|(_, v)| v).collect();
        all.sort_unstable();
        assert_eq!(all, ['a', 'b']);
        assert!(t.is_empty());
        assert_eq!(t.take(a), None);
        let c = t.insert('c');
        assert_eq!(t.take(c), Some('c'));
    }
}
