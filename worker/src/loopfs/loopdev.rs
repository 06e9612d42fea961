//! Loop devices through their ioctls: `LOOP_CTL_GET_FREE` on `/dev/loop-control` for a
//! free device, then `LOOP_CONFIGURE` binds an image file to it in one step, with
//! `LO_FLAGS_AUTOCLEAR` so the device lets go of the file when its last user (the mount)
//! closes it. The ioctl numbers and `struct loop_config` are those of
//! `<linux/loop.h>`; neither libc nor rustix carries them.

use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::path::{Path, PathBuf};

use rustix::fs::{self as rfs, Mode, OFlags};

const LOOP_CTL_GET_FREE: libc::c_ulong = 0x4C82;
const LOOP_CONFIGURE: libc::c_ulong = 0x4C0A;
const LOOP_GET_STATUS64: libc::c_ulong = 0x4C05;
const LO_FLAGS_AUTOCLEAR: u32 = 4;
const LO_NAME_SIZE: usize = 64;
const LO_KEY_SIZE: usize = 32;
/// `LOOP_CONFIGURE` answers EBUSY when another process took the same free device first.
const BUSY_RETRIES: u32 = 16;

/// `struct loop_info64`.
#[repr(C)]
struct LoopInfo64 {
    lo_device: u64,
    lo_inode: u64,
    lo_rdevice: u64,
    lo_offset: u64,
    lo_sizelimit: u64,
    lo_number: u32,
    lo_encrypt_type: u32,
    lo_encrypt_key_size: u32,
    lo_flags: u32,
    lo_file_name: [u8; LO_NAME_SIZE],
    lo_crypt_name: [u8; LO_NAME_SIZE],
    lo_encrypt_key: [u8; LO_KEY_SIZE],
    lo_init: [u64; 2],
}

/// `struct loop_config`.
#[repr(C)]
struct LoopConfig {
    fd: u32,
    block_size: u32,
    info: LoopInfo64,
    reserved: [u64; 8],
}

/// An attached loop device: its number and an open fd on it, which keeps it attached
/// until a mount holds it (closing the last user of the device detaches it).
#[derive(Debug)]
pub struct LoopDev {
    pub number: u32,
    _open: OwnedFd,
}

impl LoopDev {
    /// `/dev/loop<number>`.
    pub fn path(&self) -> PathBuf {
        PathBuf::from(format!("/dev/loop{}", self.number))
    }
}

fn get_free(control: BorrowedFd<'_>) -> std::io::Result<u32> {
    // SAFETY: LOOP_CTL_GET_FREE takes no argument and returns a device number or -1.
    let n = unsafe { libc::ioctl(control.as_raw_fd(), LOOP_CTL_GET_FREE) };
    if n < 0 {
        return Err(std::io::Error::last_os_error());
    }
    u32::try_from(n).map_err(|_| std::io::Error::other("loop-control returned a bad number"))
}

/// Binds `image` (read-write) to a free loop device with autoclear.
pub fn attach(image: BorrowedFd<'_>) -> std::io::Result<LoopDev> {
    let control = rfs::open(
        "/dev/loop-control",
        OFlags::RDWR | OFlags::CLOEXEC,
        Mode::empty(),
    )?;
    let mut last = std::io::Error::other("no free loop device");
    for _ in 0..BUSY_RETRIES {
        let number = get_free(control.as_fd())?;
        let fd = rfs::open(
            format!("/dev/loop{number}").as_str(),
            OFlags::RDWR | OFlags::CLOEXEC,
            Mode::empty(),
        )?;
        let cfg = LoopConfig {
            fd: u32::try_from(image.as_raw_fd()).map_err(|_| std::io::Error::other("bad fd"))?,
            block_size: 0,
            info: LoopInfo64 {
                lo_device: 0,
                lo_inode: 0,
                lo_rdevice: 0,
                lo_offset: 0,
                lo_sizelimit: 0,
                lo_number: 0,
                lo_encrypt_type: 0,
                lo_encrypt_key_size: 0,
                lo_flags: LO_FLAGS_AUTOCLEAR,
                lo_file_name: [0; LO_NAME_SIZE],
                lo_crypt_name: [0; LO_NAME_SIZE],
                lo_encrypt_key: [0; LO_KEY_SIZE],
                lo_init: [0; 2],
            },
            reserved: [0; 8],
        };
        // SAFETY: LOOP_CONFIGURE reads one `struct loop_config`, which `cfg` is (repr(C),
        // the kernel's layout), alive for the call.
        let r = unsafe { libc::ioctl(fd.as_raw_fd(), LOOP_CONFIGURE, &cfg as *const LoopConfig) };
        if r == 0 {
            return Ok(LoopDev { number, _open: fd });
        }
        last = std::io::Error::last_os_error();
        if last.raw_os_error() != Some(libc::EBUSY) {
            return Err(last);
        }
    }
    Err(last)
}

/// Opens `device` (a loop device that held `image` when sysfs was read) and checks that it
/// still holds that very file (device and inode, from `LOOP_GET_STATUS64`, against the
/// image's `lstat`). While the returned fd is open the device cannot let go of the image
/// (autoclear waits for its last user), so a mount made through its path meanwhile gets
/// this image's filesystem, never another's that reused the number.
pub fn hold(device: &Path, image: &Path) -> std::io::Result<OwnedFd> {
    let fd = rfs::open(device, OFlags::RDONLY | OFlags::CLOEXEC, Mode::empty())?;
    // SAFETY: a plain-data struct the kernel fills in.
    let mut info: LoopInfo64 = unsafe { std::mem::zeroed() };
    // SAFETY: LOOP_GET_STATUS64 writes one `struct loop_info64`, which `info` is.
    let r = unsafe {
        libc::ioctl(
            fd.as_raw_fd(),
            LOOP_GET_STATUS64,
            &mut info as *mut LoopInfo64,
        )
    };
    if r != 0 {
        return Err(std::io::Error::last_os_error());
    }
    let st = rfs::lstat(image)?;
    if info.lo_device != st.st_dev || info.lo_inode != st.st_ino {
        return Err(std::io::Error::other(format!(
            "{} no longer holds {}",
            device.display(),
            image.display()
        )));
    }
    Ok(fd)
}
