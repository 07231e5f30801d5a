//! pigz-style parallel gzip (docs/vmexport.md, "Export server"): fixed-size input blocks are
//! deflated independently on worker threads (each ends with a sync flush, the last with a final
//! block), written in input order as one gzip member; the CRC-32 is combined per block. At most
//! `2 * workers` blocks are in flight, so memory stays bounded.

use std::collections::BTreeMap;
use std::io::{self, Write};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use flate2::{Compress, Compression, FlushCompress, Status};

/// Input block size: large enough that the per-block sync marker and lost history cost little
/// ratio, small enough to keep every worker busy on modest inputs.
pub const BLOCK_SIZE: usize = 512 * 1024;

struct Job {
    seq: u64,
    data: Vec<u8>,
    last: bool,
}

struct Done {
    seq: u64,
    out: Vec<u8>,
    crc: crc32fast::Hasher,
}

/// A `Write` that emits a gzip stream through `sink` (called on the writing thread, in order).
pub struct ParallelGzWriter<S: FnMut(Vec<u8>) -> io::Result<()>> {
    sink: S,
    buf: Vec<u8>,
    jobs: Option<mpsc::SyncSender<Job>>,
    done: mpsc::Receiver<Done>,
    workers: Vec<JoinHandle<()>>,
    next_seq: u64,
    next_emit: u64,
    in_flight: usize,
    max_in_flight: usize,
    pending: BTreeMap<u64, Done>,
    crc: crc32fast::Hasher,
    total_len: u64,
    header_sent: bool,
    finished: bool,
}

/// Number of compression workers: the CPUs this process may use (std honours cgroup quotas
/// and the affinity mask).
pub fn default_workers() -> usize {
    std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1)
}

fn compress_block(data: &[u8], last: bool) -> Vec<u8> {
    let mut c = Compress::new(Compression::new(6), false);
    let mut out = Vec::with_capacity(data.len() / 2 + 1024);
    let flush = if last {
        FlushCompress::Finish
    } else {
        FlushCompress::Sync
    };
    loop {
        let consumed = c.total_in() as usize;
        if out.capacity() - out.len() < 64 * 1024 {
            out.reserve(64 * 1024);
        }
        let st = c
            .compress_vec(&data[consumed..], &mut out, flush)
            .expect("deflate on an in-memory buffer cannot fail");
        let all_in = c.total_in() as usize == data.len();
        match st {
            Status::StreamEnd => break,
            // A sync flush is complete once all input is consumed and output space remained.
            Status::Ok | Status::BufError if !last && all_in && out.len() < out.capacity() => {
                break;
            }
            _ => {}
        }
    }
    out
}

impl<S: FnMut(Vec<u8>) -> io::Result<()>> ParallelGzWriter<S> {
    pub fn new(workers: usize, sink: S) -> Self {
        let workers_n = workers.max(1);
        let (job_tx, job_rx) = mpsc::sync_channel::<Job>(workers_n);
        let job_rx = Arc::new(Mutex::new(job_rx));
        let (done_tx, done_rx) = mpsc::channel::<Done>();
        let workers = (0..workers_n)
            .map(|_| {
                let rx = Arc::clone(&job_rx);
                let tx = done_tx.clone();
                std::thread::spawn(move || {
                    loop {
                        let job = {
                            let guard = rx.lock().unwrap_or_else(|e| e.into_inner());
                            guard.recv()
                        };
                        let Ok(job) = job else { return };
                        let mut crc = crc32fast::Hasher::new();
                        crc.update(&job.data);
                        let out = compress_block(&job.data, job.last);
                        if tx
                            .send(Done {
                                seq: job.seq,
                                out,
                                crc,
                            })
                            .is_err()
                        {
                            return;
                        }
                    }
                })
            })
            .collect();
        ParallelGzWriter {
            sink,
            buf: Vec::with_capacity(BLOCK_SIZE),
            jobs: Some(job_tx),
            done: done_rx,
            workers,
            next_seq: 0,
            next_emit: 0,
            in_flight: 0,
            max_in_flight: 2 * workers_n,
            pending: BTreeMap::new(),
            crc: crc32fast::Hasher::new(),
            total_len: 0,
            header_sent: false,
            finished: false,
        }
    }

    fn send_header(&mut self) -> io::Result<()> {
        if !self.header_sent {
            self.header_sent = true;
            // magic, deflate, no flags, mtime 0, no extra flags, OS = Unix
            (self.sink)(vec![0x1f, 0x8b, 8, 0, 0, 0, 0, 0, 0, 3])?;
        }
        Ok(())
    }

    fn emit_ready(&mut self) -> io::Result<()> {
        while let Some(d) = self.pending.remove(&self.next_emit) {
            self.next_emit += 1;
            self.crc.combine(&d.crc);
            if !d.out.is_empty() {
                (self.sink)(d.out)?;
            }
        }
        Ok(())
    }

    fn wait_one(&mut self) -> io::Result<()> {
        let d = self
            .done
            .recv()
            .map_err(|_| io::Error::other("gzip worker exited"))?;
        self.in_flight -= 1;
        self.pending.insert(d.seq, d);
        self.emit_ready()
    }

    fn dispatch(&mut self, data: Vec<u8>, last: bool) -> io::Result<()> {
        self.send_header()?;
        while self.in_flight >= self.max_in_flight {
            self.wait_one()?;
        }
        self.total_len += data.len() as u64;
        let job = Job {
            seq: self.next_seq,
            data,
            last,
        };
        self.next_seq += 1;
        self.in_flight += 1;
        self.jobs
            .as_ref()
            .ok_or_else(|| io::Error::other("gzip stream already finished"))?
            .send(job)
            .map_err(|_| io::Error::other("gzip worker exited"))
    }

    /// Compresses what is buffered, writes the final block and the trailer.
    pub fn finish(mut self) -> io::Result<()> {
        self.finish_inner()
    }

    fn finish_inner(&mut self) -> io::Result<()> {
        if self.finished {
            return Ok(());
        }
        self.finished = true;
        let data = std::mem::take(&mut self.buf);
        self.dispatch(data, true)?;
        while self.in_flight > 0 {
            self.wait_one()?;
        }
        let mut trailer = Vec::with_capacity(8);
        trailer.extend_from_slice(&self.crc.clone().finalize().to_le_bytes());
        trailer.extend_from_slice(&(self.total_len as u32).to_le_bytes());
        (self.sink)(trailer)?;
        self.shutdown();
        Ok(())
    }

    fn shutdown(&mut self) {
        self.jobs = None;
        for w in self.workers.drain(..) {
            let _ = w.join();
        }
    }
}

impl<S: FnMut(Vec<u8>) -> io::Result<()>> Write for ParallelGzWriter<S> {
    fn write(&mut self, mut data: &[u8]) -> io::Result<usize> {
        let n = data.len();
        while !data.is_empty() {
            let room = BLOCK_SIZE - self.buf.len();
            let take = room.min(data.len());
            self.buf.extend_from_slice(&data[..take]);
            data = &data[take..];
            if self.buf.len() == BLOCK_SIZE {
                let block = std::mem::replace(&mut self.buf, Vec::with_capacity(BLOCK_SIZE));
                self.dispatch(block, false)?;
            }
        }
        Ok(n)
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

impl<S: FnMut(Vec<u8>) -> io::Result<()>> Drop for ParallelGzWriter<S> {
    fn drop(&mut self) {
        // An abandoned stream (client gone, read error) must not leave threads behind.
        self.shutdown();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Read;

    fn gz(data: &[u8], workers: usize, chunk: usize) -> Vec<u8> {
        let mut out = Vec::new();
        {
            let mut w = ParallelGzWriter::new(workers, |b| {
                out.extend_from_slice(&b);
                Ok(())
            });
            for c in data.chunks(chunk.max(1)) {
                w.write_all(c).unwrap();
            }
            w.finish().unwrap();
        }
        out
    }

    fn gunzip_single_member(z: &[u8]) -> Vec<u8> {
        // GzDecoder reads exactly one member: proves the output is a single member.
        let mut d = flate2::read::GzDecoder::new(z);
        let mut out = Vec::new();
        d.read_to_end(&mut out).unwrap();
        out
    }

    fn sample(n: usize) -> Vec<u8> {
        let mut x: u32 = 12345;
        (0..n)
            .map(|i| {
                x = x.wrapping_mul(1_103_515_245).wrapping_add(12345);
                if i % 3 == 0 {
                    (x >> 24) as u8
                } else {
                    (i / 7) as u8
                }
            })
            .collect()
    }

    #[test]
    fn round_trips_various_sizes_and_workers() {
        for n in [
            0,
            1,
            1000,
            BLOCK_SIZE - 1,
            BLOCK_SIZE,
            BLOCK_SIZE + 1,
            3 * BLOCK_SIZE + 17,
        ] {
            let data = sample(n);
            for workers in [1, 2, 4] {
                let z = gz(&data, workers, 100_000);
                assert_eq!(gunzip_single_member(&z), data, "n={n} workers={workers}");
            }
        }
    }

    #[test]
    fn compresses_zeros_well() {
        let data = vec![0u8; 4 * BLOCK_SIZE];
        let z = gz(&data, 2, BLOCK_SIZE);
        assert!(z.len() < 20_000, "{}", z.len());
        assert_eq!(gunzip_single_member(&z), data);
    }

    #[test]
    fn sink_error_stops_the_stream() {
        let mut w = ParallelGzWriter::new(2, |_b| Err(io::Error::other("client gone")));
        let data = sample(4 * BLOCK_SIZE);
        assert!(w.write_all(&data).and_then(|_| w.finish()).is_err());
    }
}
