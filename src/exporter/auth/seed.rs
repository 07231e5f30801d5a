//! The signing key from a `CONTROLLER_KEY` seed, derived exactly as the upstream Jumpstarter
//! controller derives it, so a lab switching to ucm keeps every token it minted
//! (docs/exporter.md, "The signing key").
//!
//! Upstream: SHA-256 of the seed; its first 8 bytes, big-endian, seed Go's `math/rand` source;
//! 40 bytes read from that source are `b`; the private scalar is `b mod (n − 1) + 1` (the P-256
//! key generation of Go 1.19 and earlier, kept by `filippo.io/keygen`'s `ECDSALegacy`).
//! Go's source is an additive lagged Fibonacci generator (lags 607 and 273) whose state starts
//! from a constant table ([`gorand_table`](super::gorand_table)) with the seed mixed in.
//! `math/rand` reduces a seed modulo 2³¹ − 1, so there are fewer than 2³¹ distinct keys: that is
//! upstream's strength, which compatibility requires; a lab that wants a stronger key sets
//! `--exporter-signing-key-secret` and re-enrolls (docs/exporter.md, "The signing key").

use num_bigint::BigUint;
use sha2::{Digest, Sha256};

use super::gorand_table::COOKED;

const LEN: usize = 607;
const TAP: usize = 273;
const INT32_MAX: i64 = (1 << 31) - 1;

/// P-256's group order n, big-endian.
const P256_ORDER: [u8; 32] = [
    0xff, 0xff, 0xff, 0xff, 0x00, 0x00, 0x00, 0x00, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff,
    0xbc, 0xe6, 0xfa, 0xad, 0xa7, 0x17, 0x9e, 0x84, 0xf3, 0xb9, 0xca, 0xc2, 0xfc, 0x63, 0x25, 0x51,
];

/// Go's `math/rand` seeded source with `Rand.Read` on top.
struct GoRand {
    vec: [i64; LEN],
    tap: usize,
    feed: usize,
    /// `Rand.Read` hands out each 63-bit value 7 bytes at a time, low byte first.
    read_val: i64,
    read_pos: u8,
}

/// One step of the seeding generator: x · 48271 mod (2³¹ − 1).
fn seedrand(x: i64) -> i64 {
    (x * 48271) % INT32_MAX
}

impl GoRand {
    fn new(seed: i64) -> Self {
        // Go: `seed % int32max` truncates toward zero, then a negative remainder is lifted.
        let mut seed = seed % INT32_MAX;
        if seed < 0 {
            seed += INT32_MAX;
        }
        if seed == 0 {
            seed = 89_482_311;
        }
        let mut x = seed;
        let mut vec = [0i64; LEN];
        for i in -20..LEN as i64 {
            x = seedrand(x);
            if i >= 0 {
                let mut u = x << 40;
                x = seedrand(x);
                u ^= x << 20;
                x = seedrand(x);
                u ^= x;
                vec[i as usize] = u ^ COOKED[i as usize] as i64;
            }
        }
        Self {
            vec,
            tap: 0,
            feed: LEN - TAP,
            read_val: 0,
            read_pos: 0,
        }
    }

    fn int63(&mut self) -> i64 {
        self.tap = self.tap.checked_sub(1).unwrap_or(LEN - 1);
        self.feed = self.feed.checked_sub(1).unwrap_or(LEN - 1);
        let x = self.vec[self.feed].wrapping_add(self.vec[self.tap]);
        self.vec[self.feed] = x;
        x & i64::MAX
    }

    fn read(&mut self, buf: &mut [u8]) {
        for b in buf {
            if self.read_pos == 0 {
                self.read_val = self.int63();
                self.read_pos = 7;
            }
            *b = self.read_val as u8;
            self.read_val >>= 8;
            self.read_pos -= 1;
        }
    }
}

/// The 32-byte big-endian private scalar upstream derives from `seed`.
pub(super) fn scalar_from_seed(seed: &[u8]) -> [u8; 32] {
    let digest = Sha256::digest(seed);
    let first = i64::from_be_bytes(digest[..8].try_into().expect("8 bytes"));
    let mut b = [0u8; 40];
    GoRand::new(first).read(&mut b);
    let n_minus_one = BigUint::from_bytes_be(&P256_ORDER) - 1u32;
    let k = BigUint::from_bytes_be(&b) % n_minus_one + 1u32;
    let bytes = k.to_bytes_be();
    let mut out = [0u8; 32];
    out[32 - bytes.len()..].copy_from_slice(&bytes);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seedrand_is_gos_schrage_step() {
        // Go computes the same product with Schrage's method in int32; both are x·48271 mod m.
        let schrage = |x: i32| -> i32 {
            let (hi, lo) = (x / 44488, x % 44488);
            let x = 48271 * lo - 3399 * hi;
            if x < 0 { x + 0x7fff_ffff } else { x }
        };
        for x in [1, 2, 44487, 44488, 89_482_311, 0x7fff_fffe, 123_456_789] {
            assert_eq!(seedrand(i64::from(x)), i64::from(schrage(x)), "x = {x}");
        }
    }

    #[test]
    fn a_seed_and_its_residue_modulo_int32_max_give_one_stream() {
        let mut a = GoRand::new(5);
        let mut b = GoRand::new(5 + INT32_MAX);
        let mut c = GoRand::new(5 - INT32_MAX); // negative: lifted into range
        for _ in 0..700 {
            let v = a.int63();
            assert_eq!(v, b.int63());
            assert_eq!(v, c.int63());
        }
        let mut zero = GoRand::new(0);
        let mut stand_in = GoRand::new(89_482_311);
        assert_eq!(zero.int63(), stand_in.int63());
    }
}
