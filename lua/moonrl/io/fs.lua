-- The file system through the C core's system calls (core/include/moonrl/fs.h): no path ever
-- reaches a shell. Every function raises a Lua error naming the path on failure.
--
--   fs.stat(path)          -> nil, or { is_dir =, is_file =, size =, mtime = }
--   fs.mkdirs(path)        mkdir -p
--   fs.mkdir(path)         -> true when this call created it, false when it was there
--   fs.remove(path)        a file or a whole tree (rm -rf, links never followed)
--   fs.rename(a, b)        rename, then fsync b's directory
--   fs.write(path, text)   atomically: temporary file, fsync, rename, fsync of the directory
--   fs.open(path)          -> a file open for reading ('rb'), or nil and a message; anything but a
--                            regular file (a FIFO, whose open would wait for a writer, a device, a
--                            directory) is refused before it is opened, naming the path
--   fs.open_append(path)   -> a file open for appending ('a'), or nil and a message: what is there
--                            already must be a regular file, as fs.open says
--   fs.read(path)          -> the whole file, or nil and a message (as fs.open refuses)
--   fs.read_beside(name)   -> a file in the directory of the Lua file that calls it (a plugin's own
--                            data), or an error naming it
--   fs.copy(a, b)          atomically, as write
--   fs.list(path)          -> sorted names (no . and ..)
--   fs.truncate(path, n), fs.sync_dir(path), fs.free_bytes(path)
--   fs.lock(path)          -> a lock (released by :release() or when the process ends)
--   fs.crc32c(text [, crc]), fs.crc32c_file(path) -> crc, size
--   fs.sha256(text), fs.sha256_file(path) -> 64 hex digits (as sha256sum), and the file's size
--   fs.identify(path)      -> nil, or { is_file =, size =, key = }: key the text that changes with the
--                             file's bytes: device, inode, size, mtime and ctime (links followed; a write
--                             changes ctime even when mtime is set back)
--   fs.join(a, b, ...)     'a/b/...'
local ffi = require('ffi')
local moonrl = require('moonrl')
local C = moonrl.C

local M = {}
local check = moonrl.check

local info = ffi.new('mrl_fs_info')
function M.stat(path)
  check(C.mrl_fs_stat(path, info), 2)
  if info.exists == 0 then return nil end
  return { is_dir = info.is_dir ~= 0, is_file = info.is_file ~= 0, size = tonumber(info.size),
    mtime = tonumber(info.mtime) }
end

function M.exists(path) return M.stat(path) ~= nil end
function M.is_dir(path)
  local s = M.stat(path)
  return s ~= nil and s.is_dir
end

function M.mkdirs(path) check(C.mrl_fs_mkdirs(path), 2) end

local created = ffi.new('int[1]')
function M.mkdir(path)
  check(C.mrl_fs_mkdir(path, created), 2)
  return created[0] ~= 0
end

function M.remove(path) check(C.mrl_fs_remove(path), 2) end
function M.rename(from, to) check(C.mrl_fs_rename(from, to), 2) end
function M.sync_dir(path) check(C.mrl_fs_sync_dir(path), 2) end
function M.write(path, text) check(C.mrl_fs_write_file(path, text, #text), 2) end
function M.copy(from, to) check(C.mrl_fs_copy_file(from, to), 2) end
function M.truncate(path, size) check(C.mrl_fs_truncate(path, size), 2) end

local free = ffi.new('int64_t[1]')
function M.free_bytes(path)
  check(C.mrl_fs_free_bytes(path, free), 2)
  return tonumber(free[0])
end

function M.open(path)
  if C.mrl_fs_check_readable(path) ~= 0 then return nil, moonrl.last_error() end
  return io.open(path, 'rb')
end

function M.open_append(path)
  if M.exists(path) and C.mrl_fs_check_readable(path) ~= 0 then return nil, moonrl.last_error() end
  return io.open(path, 'a')
end

function M.read(path)
  local f, err = M.open(path)
  if not f then return nil, err end
  local text, rerr = f:read('*a')
  f:close()
  if not text then return nil, path .. ': ' .. tostring(rerr) end
  return text
end

function M.read_beside(name)
  local here = debug.getinfo(2, 'S').source:match('^@(.*)/[^/]*$') or '.'
  local text, err = M.read(here .. '/' .. name)
  if not text then error(err, 2) end
  return text
end

function M.list(path)
  local out = ffi.new('mrl_fs_list *[1]')
  check(C.mrl_fs_list_open(path, out), 2)
  local l = out[0]
  local names = {}
  for i = 0, tonumber(C.mrl_fs_list_count(l)) - 1 do names[#names + 1] = ffi.string(C.mrl_fs_list_name(l, i)) end
  C.mrl_fs_list_free(l)
  return names
end

local Lock = {}
Lock.__index = Lock
function Lock:release()
  if self.fd >= 0 then C.mrl_fs_unlock(self.fd) end
  self.fd = -1
end

local lock_fd = ffi.new('int[1]')
function M.lock(path)
  check(C.mrl_fs_lock(path, lock_fd), 2)
  return setmetatable({ fd = lock_fd[0], path = path }, Lock)
end

function M.crc32c(text, crc) return tonumber(C.mrl_crc32c(crc or 0, text, #text)) end

local crc_out, size_out = ffi.new('uint32_t[1]'), ffi.new('int64_t[1]')
function M.crc32c_file(path)
  check(C.mrl_fs_crc32c_file(path, crc_out, size_out), 2)
  return tonumber(crc_out[0]), tonumber(size_out[0])
end

local digest = ffi.new('uint8_t[32]')
local function hex(d)
  local out = {}
  for i = 0, 31 do out[i + 1] = string.format('%02x', d[i]) end
  return table.concat(out)
end

function M.sha256(text)
  C.mrl_sha256(text, #text, digest)
  return hex(digest)
end

function M.sha256_file(path)
  check(C.mrl_fs_sha256_file(path, digest, size_out), 2)
  return hex(digest), tonumber(size_out[0])
end

local id = ffi.new('mrl_fs_file_id')
function M.identify(path)
  check(C.mrl_fs_identify(path, id), 2)
  if id.exists == 0 then return nil end
  -- int64 fields as exact decimal text (a double would round a large inode or nanosecond count)
  local function n(v) return (tostring(v):gsub('LL$', '')) end
  return { is_file = id.is_file ~= 0, size = tonumber(id.size),
    key = string.format('dev %s ino %s size %s mtime %s.%09d ctime %s.%09d', n(id.dev), n(id.ino), n(id.size),
      n(id.mtime_s), tonumber(id.mtime_ns), n(id.ctime_s), tonumber(id.ctime_ns)) }
end

function M.join(...) return table.concat({ ... }, '/') end

return M
